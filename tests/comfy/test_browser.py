"""The web UI path, in a real headless Chromium (Debian's package): open rank 0's ComfyUI, load the bundled tiny
workflow into the canvas the way a user does, press Queue (the frontend's own queueing), and the outputs appear
on every rank, identical. Driven over the Chrome DevTools Protocol with aiohttp (no extra packages)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest
from comfy_harness import COMFYUI_DIR, ROOT, free_port, have_comfyui, safetensors_content
from conftest import make_checkpoint, make_tiny_h3

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.comfy,
    pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}"),
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium (Debian package 'chromium'; .ci/run installs it)"),
]


class Page:
    """One browser tab over CDP: evaluate JavaScript (awaiting promises) and read the result."""

    def __init__(self, ws):
        self.ws, self.next_id = ws, 0

    async def eval(self, expression: str, timeout: float = 30):
        self.next_id += 1
        msg_id = self.next_id
        await self.ws.send_json(
            {"id": msg_id, "method": "Runtime.evaluate", "params": {"expression": expression, "awaitPromise": True, "returnByValue": True}}
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = await self.ws.receive_json(timeout=timeout)
            if msg.get("id") == msg_id:
                result = msg.get("result", {})
                if "exceptionDetails" in result:
                    raise RuntimeError(json.dumps(result["exceptionDetails"])[:1500])
                return result.get("result", {}).get("value")
        raise TimeoutError(expression)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    run = tmp_path_factory.mktemp("browser")
    base = run / "base"
    for sub in ("custom_nodes", "models/diffusion_models", "models/h3_conditioning"):
        (base / sub).mkdir(parents=True)
    os.symlink(ROOT, base / "custom_nodes" / "minimax-h3-tp2")
    make_checkpoint(str(base / "models/diffusion_models/h3_tiny_int8.safetensors"), "--int8")
    make_tiny_h3.main(["--conditioning", str(base / "models/h3_conditioning/h3_tiny_cond.safetensors")])
    port = free_port()
    env = dict(os.environ, PYTHON=sys.executable)
    cmd = [os.path.join(ROOT, "scripts", "start-tp2.sh"), "--comfyui", COMFYUI_DIR, "--tp-size", "2", "--cpu", "--run-dir", str(run / "ranks"),
           "--base-dir", str(base), "--base-port", str(port), "--", "--disable-api-nodes"]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    yield {"urls": [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"], "run": run / "ranks", "tmp": run}
    subprocess.run(
        [os.path.join(ROOT, "scripts", "start-tp2.sh"), "stop", "--run-dir", str(run / "ranks")], capture_output=True, timeout=60
    )


async def _queue_from_ui(url: str, workflow: dict, profile: str) -> None:
    port = free_port()
    browser = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}", f"--remote-debugging-port={port}", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session:
            target = None
            for _ in range(100):
                try:
                    async with session.get(f"http://127.0.0.1:{port}/json") as r:
                        target = next((t for t in await r.json() if t.get("type") == "page"), None)
                    if target:
                        break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
            assert target, "Chromium exposed no page to DevTools"
            async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                for _ in range(150):  # the frontend boots: wait until its app and graph exist
                    if await page.eval("!!(window.app && window.app.graph && window.app.api)"):
                        break
                    await asyncio.sleep(0.2)
                else:
                    raise AssertionError("ComfyUI's frontend did not start in the browser")
                await page.eval(f"window.app.loadGraphData({json.dumps(workflow)})")
                assert await page.eval("window.app.graph._nodes.length") == len(workflow["nodes"])
                await page.eval("window.app.queuePrompt(0, 1)")
    finally:
        browser.terminate()
        browser.wait(10)


def _latents(run, rank: int) -> dict[str, bytes]:
    d = run / f"rank{rank}" / "output" / "latents"
    return {f.name: f.read_bytes() for f in sorted(d.glob("h3_tiny_demo_*"))} if d.exists() else {}


def test_queue_in_rank0_browser_runs_on_every_rank(ranks):
    workflow = json.load(open(os.path.join(ROOT, "workflows", "h3_tp2_tiny_demo.json")))
    asyncio.run(_queue_from_ui(ranks["urls"][0], workflow, str(ranks["tmp"] / "chromium-profile")))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        outs = [_latents(ranks["run"], r) for r in (0, 1)]
        if all(len(o) == 2 for o in outs):
            break
        time.sleep(0.5)
    assert all(len(o) == 2 for o in outs), outs
    assert outs[0].keys() == outs[1].keys()
    assert all(safetensors_content(outs[0][k]) == safetensors_content(outs[1][k]) for k in outs[0])
    with urllib.request.urlopen(ranks["urls"][1] + "/history", timeout=10) as r:
        follower = json.loads(r.read())
    assert len(follower) == 1 and next(iter(follower.values()))["status"]["status_str"] == "success"
