"""The web UI path, in a real headless Chromium (Debian's package): open rank 0's ComfyUI, load the bundled tiny
workflow into the canvas the way a user does, press Queue (the frontend's own queueing), and the outputs appear
on every rank, identical. Driven over the Chrome DevTools Protocol with aiohttp (no extra packages)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from comfy_harness import COMFYUI_DIR, ROOT, free_port, have_comfyui, launch, safetensors_content, stop_launched, tiny_base

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
    launched = launch(run, tiny_base(run))
    yield {"urls": launched["urls"], "run": Path(launched["run_dir"]), "tmp": run}
    stop_launched(launched)


async def _in_browser(url: str, profile: str, action) -> object:
    """Open `url` in headless Chromium, wait for ComfyUI's frontend to boot, then `await action(page)`."""
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
                return await action(page)
    finally:
        browser.terminate()
        browser.wait(10)


async def _queue_from_ui(url: str, workflow: dict, profile: str) -> None:
    async def queue(page):
        await page.eval(f"window.app.loadGraphData({json.dumps(workflow)})")
        assert await page.eval("window.app.graph._nodes.length") == len(workflow["nodes"])
        await page.eval("window.app.queuePrompt(0, 1)")

    await _in_browser(url, profile, queue)


async def _banner_text(url: str, profile: str) -> str | None:
    async def read(page):
        for _ in range(50):
            text = await page.eval("document.getElementById('tp2-rank-banner')?.innerText ?? null")
            if text:
                return text
            await asyncio.sleep(0.2)
        return None

    return await _in_browser(url, profile, read)


def test_follower_ui_says_it_is_a_follower_and_links_rank0(ranks):
    follower = asyncio.run(_banner_text(ranks["urls"][1], str(ranks["tmp"] / "chromium-banner-1")))
    assert follower and "rank 1 of 2, a follower" in follower and ranks["urls"][0] in follower, follower
    front = asyncio.run(_banner_text(ranks["urls"][0], str(ranks["tmp"] / "chromium-banner-0")))
    assert front and "rank 0 of 2" in front, front


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
