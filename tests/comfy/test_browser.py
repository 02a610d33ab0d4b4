"""The web UI path, in a real headless Chromium (Debian's package): open rank 0's ComfyUI, load the bundled tiny
workflow into the canvas the way a user does, press Queue (the frontend's own queueing), and the outputs appear
on every rank, identical; rank 0's TP panel (web/tp2_panel.js) shows both ranks healthy and rank 1's own sampler
steps during a run, and the status node's text on the canvas; the template cards' thumbnails are served. Driven
over the Chrome DevTools Protocol with aiohttp (no extra packages)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from comfy_harness import COMFYUI_DIR, ROOT, free_port, have_comfyui, launch, stop_launched, tiny_base

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

    async def call(self, method: str, params: dict, timeout: float = 30) -> dict:
        """One DevTools command; its result."""
        self.next_id += 1
        msg_id = self.next_id
        await self.ws.send_json({"id": msg_id, "method": method, "params": params})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = await self.ws.receive_json(timeout=timeout)
            if msg.get("id") == msg_id:
                return msg.get("result", {})
        raise TimeoutError(method)

    async def eval(self, expression: str, timeout: float = 30):
        result = await self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True}, timeout)
        if "exceptionDetails" in result:
            raise RuntimeError(json.dumps(result["exceptionDetails"])[:1500])
        return result.get("result", {}).get("value")

    async def screenshot(self, path) -> bytes:
        import base64

        blob = base64.b64decode((await self.call("Page.captureScreenshot", {"format": "png"}))["data"])
        Path(path).write_bytes(blob)
        return blob


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
         "--disable-component-update", "--disable-sync", "--window-size=1500,950", f"--user-data-dir={profile}", f"--remote-debugging-port={port}", url],
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


SHOWN_WEBP = """(() => {
  const node = window.app.graph._nodes.find(n => n.type === 'SaveAnimatedWEBP');
  const srcs = [...(node?.imgs ?? []).map(i => i.src), ...[...document.querySelectorAll('img')].map(i => i.src)];
  return srcs.filter(s => s.includes('.webp')).map(s => new URL(s).searchParams.get('filename'));
})()"""


async def _queue_from_ui(url: str, workflow: dict, profile: str) -> list[str]:
    """Load `workflow` into rank 0's canvas and press Queue; the .webp files the page then shows (up to 120 s)."""

    async def queue(page):
        await page.eval(f"window.app.loadGraphData({json.dumps(workflow)})")
        assert await page.eval("window.app.graph._nodes.length") == len(workflow["nodes"])
        await page.eval("window.app.queuePrompt(0, 1)")
        for _ in range(600):
            shown = await page.eval(SHOWN_WEBP)
            if shown:
                return shown
            await asyncio.sleep(0.2)
        return []

    return await _in_browser(url, profile, queue)


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
    shown = asyncio.run(_queue_from_ui(ranks["urls"][0], workflow, str(ranks["tmp"] / "chromium-profile")))
    webps = [sorted(p.name for p in (ranks["run"] / f"rank{r}" / "output").glob("h3_tiny_demo_*.webp")) for r in (0, 1)]
    assert shown and set(shown) <= set(webps[0]), f"rank 0's page shows no animated WEBP of the run: {shown}, saved {webps}"
    assert webps[0] == webps[1] and all(
        (ranks["run"] / "rank0" / "output" / n).read_bytes() == (ranks["run"] / "rank1" / "output" / n).read_bytes() for n in webps[0]
    ), "the ranks' animated WEBPs differ"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        outs = [_latents(ranks["run"], r) for r in (0, 1)]
        if all(len(o) == 2 for o in outs):
            break
        time.sleep(0.5)
    assert all(len(o) == 2 for o in outs), outs
    assert outs[0] == outs[1], "the ranks' .latent files differ"
    with urllib.request.urlopen(ranks["urls"][1] + "/history", timeout=10) as r:
        follower = json.loads(r.read())
    assert len(follower) == 1 and next(iter(follower.values()))["status"]["status_str"] == "success"


# -- the TP panel and the status node (issue 18) ------------------------------------------------------------

STEPS = 12  # the tiny sampler takes about 0.5 s a step on 2 busy cores: long enough to see rank 1 mid-run

OPEN_PANEL = """(async () => {
  for (let i = 0; i < 100 && !document.querySelector('.tp2-tab-button'); i++) await new Promise(r => setTimeout(r, 100));
  const button = document.querySelector('.tp2-tab-button');
  if (!button) return false;
  button.click();
  return true;
})()"""

RANK_ROWS = """[...document.querySelectorAll('#tp2-ranks .tp2-rank')].map(r => ({rank: +r.dataset.rank, health: r.dataset.health,
  prompt: r.dataset.prompt, value: r.dataset.value, max: r.dataset.max, running: r.dataset.running,
  progress: r.querySelector('.tp2-progress').innerText.replace(/^progress: /, ''),
  group: r.querySelector('.tp2-group').innerText.replace(/^process group: /, ''),
  link: r.querySelector('.tp2-link').innerText.replace(/^link: /, '')}))"""

ADD_STATUS_NODE = """(() => {
  const g = window.app.graph;
  const sampler = g._nodes.find(n => n.type === 'KSampler');
  sampler.widgets.find(w => w.name === 'steps').value = STEPS;
  sampler.widgets.find(w => w.name === 'seed').value = SEED;  // a prompt no rank has cached
  const LG = window.LiteGraph ?? window.comfyAPI?.litegraph?.LiteGraph;
  const status = LG.createNode('TP2Status');
  status.pos = [sampler.pos[0] + sampler.size[0] + 40, sampler.pos[1]];
  g.add(status);
  sampler.connect(0, status, 0);  // 'after': the status node runs after the sampler
  window.app.canvas.ds.scale = 0.8;  // the status node in view, right of the panel
  window.app.canvas.ds.offset = [-status.pos[0] + 560, -status.pos[1] + 200];
  window.app.canvas.setDirty(true, true);
  window.__tp2_started = [];
  window.app.api.addEventListener('execution_start', e => window.__tp2_started.push(e.detail.prompt_id));
  return status.id;
})()""".replace("STEPS", str(STEPS)).replace("SEED", str(1000 + int(time.time()) % 100000))

DIALOGS = "[...document.querySelectorAll('[role=dialog]')].map(d => d.innerText.slice(0, 40))"

STATUS_TEXT_ON_CANVAS = """(() => {
  const pre = document.querySelector('.tp2-status-text');
  if (!pre) return null;
  const box = pre.getBoundingClientRect();
  const visible = box.width > 50 && box.height > 30 && box.bottom > 0 && box.right > 0 && box.top < innerHeight && box.left < innerWidth;
  return {text: pre.innerText, visible};
})()"""


async def _panel_and_status_run(url: str, workflow: dict, profile: str, shot) -> dict:
    """Rank 0's page: open the TP panel, read its rows, queue the tiny workflow with a status node after the sampler,
    and watch rank 1's row until the status node shows its text; then a screenshot."""

    async def act(page):
        seen = {"before": None, "rows": [], "status": None}
        assert await page.eval(OPEN_PANEL), "no TP button in the sidebar"
        for _ in range(100):
            rows = await page.eval(RANK_ROWS)
            if len(rows) == 2 and all(r["health"] == "healthy" for r in rows):
                break
            await asyncio.sleep(0.2)
        seen["before"] = {"rows": rows, "summary": await page.eval("document.getElementById('tp2-summary')?.innerText"),
                          "title": await page.eval("document.getElementById('tp2-summary')?.previousElementSibling?.innerText")}  # fmt: skip
        await page.eval(f"window.app.loadGraphData({json.dumps(workflow)})")
        await page.eval(ADD_STATUS_NODE)
        await page.eval("window.app.queuePrompt(0, 1)")
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            seen["rows"].append(await page.eval(RANK_ROWS))
            status = await page.eval(STATUS_TEXT_ON_CANVAS)
            if status and "rank 0 of tp_size 2" in status["text"]:
                seen["status"] = status
                break
            await asyncio.sleep(0.1)
        for _ in range(150):  # the run ends (the decode and the saves come after the status node): the panel's next polls
            await asyncio.sleep(0.2)
            seen["after"] = await page.eval(RANK_ROWS)
            if all(r["running"] == "false" for r in seen["after"]):
                break
        seen["prompt_ids"] = await page.eval("window.__tp2_started")
        seen["dialogs"] = await page.eval(DIALOGS)
        for _ in range(3):  # a fresh profile's template browser may have opened over the canvas
            if not await page.eval(DIALOGS):
                break
            await page.call("Input.dispatchKeyEvent", {"type": "keyDown", "key": "Escape", "code": "Escape", "windowsVirtualKeyCode": 27})
            await asyncio.sleep(0.5)
        seen["shot"] = len(await page.screenshot(shot))
        return seen

    return await _in_browser(url, profile, act)


def test_tp_panel_shows_both_ranks_and_rank1_progress_and_status_node_text(ranks):
    """Issue 18's evidence: rank 0's TP panel lists 2 healthy ranks; while the tiny workflow runs it shows rank 1's
    sampler steps (read from rank 1's own progress registry through rank 0's /tp2/cluster); the status node, run
    after the sampler through its optional input, shows its text on the canvas with this prompt's agreement."""
    workflow = json.load(open(os.path.join(ROOT, "workflows", "h3_tp2_tiny_demo.json")))
    shot = ranks["tmp"] / "tp2_panel.png"
    seen = asyncio.run(_panel_and_status_run(ranks["urls"][0], workflow, str(ranks["tmp"] / "chromium-panel"), shot))
    print(f"screenshot: {shot}")
    before = seen["before"]
    assert [(r["rank"], r["health"]) for r in before["rows"]] == [(0, "healthy"), (1, "healthy")], before
    assert before["summary"] == "2 of 2 ranks healthy" and before["title"] == "Tensor parallel: 2 ranks, split even", before
    assert len(seen["prompt_ids"]) == 1, seen["prompt_ids"]
    pid = seen["prompt_ids"][0]
    rank1 = [row for rows in seen["rows"] for row in rows if row["rank"] == 1 and row["prompt"] == pid]
    mid_run = {int(r["value"]) for r in rank1 if r["running"] == "true" and r["max"] == str(STEPS) and 0 < int(r["value"] or 0) < STEPS}
    assert mid_run, f"rank 1's sampler steps never showed in the panel during the run: {[r['progress'] for r in rank1]}"
    assert any(f"KSampler {v}/{STEPS} (running)" == r["progress"] for r in rank1 for v in mid_run), rank1
    final = next(r for r in seen["after"] if r["rank"] == 1)
    assert final["prompt"] == pid and final["value"] == final["max"] == str(STEPS) and final["running"] == "false", final
    assert final["group"].startswith("formed, generation"), final
    assert re.fullmatch(r"[\d.]+ GB/s \(gloo, host memory\); speed-up not predicted: .*", final["link"]), final  # measured as it formed
    status = seen["status"]
    assert status is not None, "the status node's text never appeared on the canvas"
    assert status["visible"], status
    assert f"last agreement: {pid}." in status["text"] and "/sampler1: ok" in status["text"], status["text"]
    assert seen["shot"] > 20_000 and shot.stat().st_size == seen["shot"]


def _status_outputs(url: str, prompt_id: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/history/{prompt_id}", timeout=10) as r:
        entry = json.loads(r.read())[prompt_id]
    assert entry["status"]["status_str"] == "success", entry["status"]
    return [t for out in entry["outputs"].values() for t in out.get("text", [])]


def test_status_node_lists_a_reloaded_model_once(ranks):
    """A model loaded again (after "Unload models and execution cache") is listed once, with its load count, on
    every rank; before, each load added a line."""
    from comfy_harness import call, demo_workflow, wait_done

    url0 = ranks["urls"][0]
    texts = []
    for seed in (1, 2):
        wf = demo_workflow(f"dedupe{seed}", steps=1, seed=seed)
        wf["9"] = {"class_type": "TP2Status", "inputs": {"after": ["5", 0]}}
        status, body = call(url0, "/prompt", {"prompt": wf, "client_id": "tests"})
        assert status == 200, body
        for url in ranks["urls"]:
            wait_done(url, body["prompt_id"])
            texts.append(_status_outputs(url, body["prompt_id"]))
        assert call(url0, "/free", {"unload_models": True, "free_memory": True})[0] == 200
    for outputs in texts:
        assert len(outputs) == 1
    last = texts[-2:]  # the second prompt, rank 0 and rank 1: the model was built again after the free
    for outputs in last:
        models = [line for line in outputs[0].splitlines() if line.startswith("model ")]
        assert len(models) == 1 and "h3_tiny_int8.safetensors" in models[0], outputs[0]
        assert re.search(r"loaded [2-9] times", models[0]), models[0]


def test_template_cards_have_their_thumbnails(ranks):
    """The template browser lists the pack's workflows and asks for /api/workflow_templates/<pack>/<NAME>.jpg for
    each card (the frontend fixes .jpg for packs' templates): every bundled workflow's picture is served, is a
    JPEG and is what scripts/make_thumbnails.py draws from it now."""
    import io
    import subprocess
    import sys

    from PIL import Image

    url = ranks["urls"][0]
    with urllib.request.urlopen(url + "/api/workflow_templates", timeout=10) as r:
        listed = json.loads(r.read())
    names = sorted(os.path.splitext(f)[0] for f in os.listdir(os.path.join(ROOT, "workflows")) if f.endswith(".json"))
    pack = next(k for k, v in listed.items() if "h3_tp2_tiny_demo" in v)
    assert sorted(listed[pack]) == names and len(names) == 6, listed
    for name in names:
        with urllib.request.urlopen(f"{url}/api/workflow_templates/{pack}/{name}.jpg", timeout=10) as r:
            assert r.headers["Content-Type"] == "image/jpeg", (name, r.headers["Content-Type"])
            image = Image.open(io.BytesIO(r.read()))
        assert image.format == "JPEG" and image.size == (400, 300), (name, image.format, image.size)
    check = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_thumbnails.py"), "--check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


TOASTS = "[...document.querySelectorAll('.p-toast-message')].map(e => e.innerText)"


def test_a_nodes_warning_is_a_toast_that_stays_on_rank0s_page(ranks):
    """A LoRA of another model (SD-style keys) through LoraLoaderModelOnly warned only in the rank's log while the web UI
    said success (issue 49). Queued from rank 0's page (its own client id), the run ends with the node's warning in a
    toast (web/tp2_panel.js), still shown seconds later; the run itself succeeds on every rank."""
    import torch
    from comfy_harness import wait_done
    from safetensors.torch import save_file

    loras = ranks["tmp"] / "base" / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    keys = [f"lora_unet_down_blocks_{i}_attn1_to_q.{f}.weight" for i in range(3) for f in ("lora_up", "lora_down")]
    save_file({k: torch.zeros(4, 4) for k in keys}, str(loras / "not_h3_in_browser.safetensors"))
    api = json.load(open(os.path.join(ROOT, "workflows", "api", "h3_tp2_tiny_demo.json")))
    api["20"] = {
        "class_type": "LoraLoaderModelOnly",
        "inputs": {"model": ["1", 0], "lora_name": "not_h3_in_browser.safetensors", "strength_model": 1.0},
    }
    api["5"]["inputs"]["model"] = ["20", 0]
    api["5"]["inputs"]["seed"] = 4049  # not a prompt the cache holds the outputs of

    async def queue(page):
        queued = await page.eval(f"window.app.api.queuePrompt(0, {{output: {json.dumps(api)}}})")
        for _ in range(900):
            if any("patched nothing of the model" in t for t in await page.eval(TOASTS)):
                await asyncio.sleep(3.0)
                return queued, await page.eval(TOASTS)
            await asyncio.sleep(0.2)
        return queued, await page.eval(TOASTS)

    queued, toasts = asyncio.run(_in_browser(ranks["urls"][0], str(ranks["tmp"] / "chromium-toast"), queue))
    warned = [t for t in toasts if "patched nothing of the model (0 of its 3 layers matched)" in t]
    assert len(warned) == 1 and "minimax-h3-tp2: " in warned[0], toasts  # every rank runs the node; the page's rank 0 tells it
    for url in ranks["urls"]:
        assert wait_done(url, queued["prompt_id"])["status"]["status_str"] == "success"
