"""Rank 0 as the front door, on real ComfyUI servers started by scripts/start-tp2.sh (CPU, gloo): a prompt queued
only on rank 0 (API, or the web UI's own request shape) runs on every rank with identical bytes; dual-submit
runs once per rank; followers refuse unauthenticated prompts; interrupt and clear-queue reach every rank; a
follower that is down fails rank 0's prompt at once, naming it, and the next prompt works once it is back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from comfy_harness import COMFYUI_DIR, ROOT, have_comfyui, launch, safetensors_content, stop_launched, tiny_base

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

TINY_API = os.path.join(ROOT, "workflows", "api", "h3_tp2_tiny_demo.json")
TINY_UI = os.path.join(ROOT, "workflows", "h3_tp2_tiny_demo.json")


def call(url: str, path: str, body: dict | None = None, headers: dict | None = None, timeout: float = 30):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def wait_done(url: str, prompt_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, h = call(url, f"/history/{prompt_id}")
        if prompt_id in h and h[prompt_id]["status"].get("status_str") in ("success", "error"):
            return h[prompt_id]
        time.sleep(0.1)
    raise TimeoutError(f"{prompt_id} not done on {url} after {timeout} s")


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    run = tmp_path_factory.mktemp("front")
    launched = launch(run, tiny_base(run), {"TP2_PROMPT_TIMEOUT_S": "15", "TP2_TIMEOUT_S": "20"})
    run_dir = Path(launched["run_dir"])
    yield {"urls": launched["urls"], "run": run_dir, "secret": (run_dir / "secret").read_text().strip()}
    stop_launched(launched)


def workflow(prefix: str, steps: int = 3, seed: int = 145) -> dict:
    wf = json.load(open(TINY_API))
    wf["5"]["inputs"].update(steps=steps, seed=seed)
    wf["7"]["inputs"]["filename_prefix"] = f"latents/{prefix}_video"
    wf["8"]["inputs"]["filename_prefix"] = f"latents/{prefix}_audio"
    return wf


def outputs(front, rank: int, prefix: str) -> dict[str, bytes]:
    d = front["run"] / f"rank{rank}" / "output" / "latents"
    return {f.name: f.read_bytes() for f in sorted(d.glob(f"{prefix}_*"))} if d.exists() else {}


def test_prompt_posted_only_to_rank0_runs_on_every_rank(front):
    status, body = call(front["urls"][0], "/prompt", {"prompt": workflow("only0")})
    assert status == 200, body
    hs = [wait_done(u, body["prompt_id"]) for u in front["urls"]]
    assert all(h["status"]["status_str"] == "success" for h in hs), hs
    a, b = outputs(front, 0, "only0"), outputs(front, 1, "only0")
    assert len(a) == 2 and a == b


def test_web_ui_request_shape_runs_on_every_rank(front):
    """What the frontend sends on Queue: POST /api/prompt with client_id and the canvas workflow in extra_pnginfo."""
    body = {
        "client_id": "browser-tab-1",
        "prompt": workflow("uishape"),
        "extra_data": {"extra_pnginfo": {"workflow": json.load(open(TINY_UI))}},
    }
    status, answer = call(front["urls"][0], "/api/prompt", body)
    assert status == 200, answer
    hs = [wait_done(u, answer["prompt_id"]) for u in front["urls"]]
    assert all(h["status"]["status_str"] == "success" for h in hs)
    a, b = outputs(front, 0, "uishape"), outputs(front, 1, "uishape")
    assert len(a) == 2 and a.keys() == b.keys()
    # with the canvas workflow in the metadata the header has two keys, whose order safetensors does not fix
    assert all(safetensors_content(a[k]) == safetensors_content(b[k]) for k in a)


def test_dual_submit_runs_once_per_rank(front):
    pid = "0b7a1f0e-6c1d-4d2b-9b7e-3f8e2c1a9d55"
    body = {"prompt": workflow("dual"), "prompt_id": pid}
    headers = {"X-TP2-Secret": front["secret"]}
    for url in reversed(front["urls"]):  # the follower first, so rank 0's forward is the duplicate
        status, answer = call(url, "/prompt", body, headers)
        assert status == 200 and answer["prompt_id"] == pid, answer
    for u in front["urls"]:
        assert wait_done(u, pid)["status"]["status_str"] == "success"
    time.sleep(1.0)
    a, b = outputs(front, 0, "dual"), outputs(front, 1, "dual")
    assert len(a) == 2 and a == b, (sorted(a), sorted(b))  # one video + one audio latent each: ran once


def test_follower_refuses_prompts_without_the_secret(front):
    status, body = call(front["urls"][1], "/prompt", {"prompt": workflow("direct")})
    assert status == 403
    assert "tensor-parallel rank 1 of 2, a follower: queue prompts on rank 0" in body["error"]["message"]
    status, body = call(front["urls"][1], "/prompt", {"prompt": workflow("direct")}, {"X-TP2-Secret": "0" * 64})
    assert status == 403


def test_interrupt_on_rank0_stops_every_rank_then_next_prompt_works(front):
    status, body = call(front["urls"][0], "/prompt", {"prompt": workflow("long", steps=400)})
    assert status == 200
    pid = body["prompt_id"]
    time.sleep(4)
    t0 = time.monotonic()
    call(front["urls"][0], "/interrupt", {})
    hs = []
    for u in front["urls"]:
        hs.append(wait_done(u, pid, timeout=30))
        print(f"{u} done after {time.monotonic() - t0:.1f} s: {hs[-1]['status']['messages'][-1][0]}")
    assert time.monotonic() - t0 < 10
    for h in hs:
        assert h["status"]["status_str"] == "error" and any(k == "execution_interrupted" for k, _ in h["status"]["messages"]), h["status"]
    status, body = call(front["urls"][0], "/prompt", {"prompt": workflow("after_interrupt")})
    assert all(wait_done(u, body["prompt_id"])["status"]["status_str"] == "success" for u in front["urls"])


def test_clear_queue_on_rank0_reaches_followers(front):
    status, running = call(front["urls"][0], "/prompt", {"prompt": workflow("busy", steps=400)})
    time.sleep(2)
    status, waiting = call(front["urls"][0], "/prompt", {"prompt": workflow("waiting")})
    time.sleep(1)
    assert any(item[1] == waiting["prompt_id"] for item in call(front["urls"][1], "/queue")[1]["queue_pending"])
    call(front["urls"][0], "/queue", {"clear": True})
    time.sleep(1)
    for u in front["urls"]:
        assert not call(u, "/queue")[1]["queue_pending"], u
    call(front["urls"][0], "/interrupt", {})
    for u in front["urls"]:
        wait_done(u, running["prompt_id"], timeout=30)


def test_follower_down_fails_fast_naming_it_then_recovers(front):
    pids = {int(line.split()[0]): int(line.split()[1]) for line in (front["run"] / "pids").read_text().split("\n") if line.strip()}
    pid1 = pids[1]
    cmdline = open(f"/proc/{pid1}/cmdline", "rb").read().split(b"\0")[:-1]
    environ = dict(e.split(b"=", 1) for e in open(f"/proc/{pid1}/environ", "rb").read().split(b"\0") if b"=" in e)
    cwd = os.readlink(f"/proc/{pid1}/cwd")
    os.killpg(pid1, signal.SIGKILL)
    time.sleep(0.5)
    t0 = time.monotonic()
    status, body = call(front["urls"][0], "/prompt", {"prompt": workflow("down")})
    assert status == 503 and time.monotonic() - t0 < 60, body
    assert "rank 1 (http://127.0.0.1:" in body["error"]["message"] and "is not reachable" in body["error"]["message"]
    log = open(front["run"] / "rank1.log", "ab")
    proc = subprocess.Popen(
        cmdline, cwd=cwd, env={k.decode(): v.decode() for k, v in environ.items()}, stdout=log, stderr=log, start_new_session=True
    )
    (front["run"] / "pids").write_text(
        f"0 {pids[0]} {front['urls'][0].rsplit(':', 1)[1]}\n1 {proc.pid} {front['urls'][1].rsplit(':', 1)[1]}\n"
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            call(front["urls"][1], "/system_stats", timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    status, body = call(front["urls"][0], "/prompt", {"prompt": workflow("back")})
    assert status == 200, body
    for u in front["urls"]:
        h = wait_done(u, body["prompt_id"])
        assert h["status"]["status_str"] == "success", (u, h["status"]["messages"][-1:])
    assert outputs(front, 0, "back") == outputs(front, 1, "back")
