"""Rank 0 as the front door, on real ComfyUI servers started by scripts/start-tp2.sh (CPU, gloo): a prompt queued
only on rank 0 (API, or the web UI's own request shape) runs on every rank with identical bytes; followers refuse
prompts that did not come from rank 0's dispatcher; an interrupt on rank 0 stops every rank; a follower that is
down fails rank 0's prompt when it starts, naming it, and the next prompt works once it is back.
The lockstep cases (cancel, free, concurrent clients, failures, frozen and killed ranks) are in test_lockstep.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from comfy_harness import (
    COMFYUI_DIR,
    ROOT,
    call,
    error_text,
    have_comfyui,
    launch,
    saved_sha256,
    stop_launched,
    tiny_base,
    wait_done,
)  # fmt: skip
from comfy_harness import demo_workflow as workflow
from conftest import assert_within

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

TINY_UI = os.path.join(ROOT, "workflows", "h3_tp2_tiny_demo.json")


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    run = tmp_path_factory.mktemp("front")
    launched = launch(run, tiny_base(run), {"TP2_PROMPT_TIMEOUT_S": "15", "TP2_TIMEOUT_S": "20"})
    run_dir = Path(launched["run_dir"])
    yield {"urls": launched["urls"], "run": run_dir, "secret": (run_dir / "secret").read_text().strip()}
    stop_launched(launched)


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


def test_web_ui_request_shape_writes_the_same_bytes_on_every_rank(front):
    """What the frontend sends on Queue: POST /api/prompt with client_id and the canvas workflow in extra_pnginfo.
    Every file every rank saved has the same sha256: the animated WEBP and 8 .latent files, whose header keys
    (prompt, workflow) safetensors writes in a per-process hash map's order, so without the pack's comparison each
    differs between two processes about half the time (all 8 equal by chance: 1 in 256)."""
    wf = workflow("uishape")
    for i in range(6):  # more of the same latent: more headers that could differ
        wf[f"{20 + i}"] = {"class_type": "SaveLatent", "inputs": {"samples": ["6", i % 2], "filename_prefix": f"latents/uishape_more{i}"}}
    body = {"client_id": "browser-tab-1", "prompt": wf, "extra_data": {"extra_pnginfo": {"workflow": json.load(open(TINY_UI))}}}
    status, answer = call(front["urls"][0], "/api/prompt", body)
    assert status == 200, answer
    hs = [wait_done(u, answer["prompt_id"]) for u in front["urls"]]
    assert all(h["status"]["status_str"] == "success" for h in hs), [error_text(h) for h in hs]
    a, b = (saved_sha256(str(front["run"] / f"rank{r}" / "output"), h) for r, h in enumerate(hs))
    assert sorted(p.rsplit(".", 1)[1] for p in a) == ["latent"] * 8 + ["webp"], a
    assert a == b, {p: (a[p], b.get(p)) for p in a if a[p] != b.get(p)}


def test_prompt_sent_straight_to_a_follower_is_refused_even_with_the_secret(front):
    """Only rank 0's dispatcher queues on a follower: a prompt that skipped rank 0 would run on one rank alone."""
    status, body = call(front["urls"][1], "/prompt", {"prompt": workflow("straight")}, {"X-TP2-Secret": front["secret"]})
    assert status == 403 and "only from rank 0's dispatcher" in body["error"]["message"], body


def test_follower_refuses_prompts_without_the_secret(front):
    status, body = call(front["urls"][1], "/prompt", {"prompt": workflow("direct")})
    assert status == 403
    assert "tensor-parallel rank 1 of 2, a follower: use rank 0" in body["error"]["message"]
    status, body = call(front["urls"][1], "/prompt", {"prompt": workflow("direct")}, {"X-TP2-Secret": "0" * 64})
    assert status == 403


@pytest.mark.parametrize("path", ["/api/api/jobs/some-id/cancel", "/api/api/jobs/cancel", "/api/api/interrupt", "/api/api/prompt"])
def test_follower_refuses_doubled_api_prefixes_without_the_secret(front, path):
    """ComfyUI serves every route again under /api, /api/... routes included: the follower's guard is not a list of
    spellings, so /api/api/... is refused like the route it reaches."""
    status, body = call(front["urls"][1], path, {"job_ids": ["some-id"]})
    assert status == 403 and "a follower: use rank 0" in body["error"]["message"], (status, body)


def test_interrupt_on_rank0_stops_every_rank_then_next_prompt_works(front):
    status, body = call(front["urls"][0], "/prompt", {"prompt": workflow("long", steps=400)})
    assert status == 200
    pid = body["prompt_id"]
    time.sleep(4)
    t0 = time.monotonic()
    call(front["urls"][0], "/interrupt", {})
    hs = []
    for u in front["urls"]:
        hs.append(wait_done(u, pid, timeout=180))
        print(f"{u} done after {time.monotonic() - t0:.1f} s: {hs[-1]['status']['messages'][-1][0]}")
    assert_within(time.monotonic() - t0, 10, "the interrupt reaching every rank")
    for h in hs:
        assert h["status"]["status_str"] == "error" and any(k == "execution_interrupted" for k, _ in h["status"]["messages"]), h["status"]
    status, body = call(front["urls"][0], "/prompt", {"prompt": workflow("after_interrupt")})
    assert all(wait_done(u, body["prompt_id"])["status"]["status_str"] == "success" for u in front["urls"])


def test_a_prompt_waits_for_a_follower_the_launcher_restarts_and_fails_fast_when_none_does(front):
    """A follower killed: a prompt queued on rank 0 waits while the launcher starts it again, then runs on every rank.
    A follower killed with its supervisor gone (nothing will start it): the prompt fails at once, naming the rank,
    and `restart --rank 1` brings it back."""
    pid1 = int((front["run"] / "pids").read_text().split("\n")[1].split()[1])
    os.killpg(pid1, signal.SIGKILL)
    time.sleep(0.3)
    status, body = call(front["urls"][0], "/prompt", {"prompt": workflow("down")})
    assert status == 200, body
    for u in front["urls"]:
        h = wait_done(u, body["prompt_id"], timeout=150)
        assert h["status"]["status_str"] == "success", (u, error_text(h))
    assert outputs(front, 0, "down") == outputs(front, 1, "down") != {}
    notes = (front["run"] / "rank1.restarts").read_text()
    assert "exited killed by signal 9 (KILL); restart 1 of 5" in notes, notes
    assert "not reachable while the launcher starts them again" in (front["run"] / "rank0.log").read_text()

    os.kill(int((front["run"] / "rank1.supervisor").read_text()), signal.SIGKILL)
    pid1 = int((front["run"] / "pids").read_text().split("\n")[1].split()[1])
    os.killpg(pid1, signal.SIGKILL)
    time.sleep(0.3)
    t0 = time.monotonic()
    status, body = call(front["urls"][0], "/prompt", {"prompt": workflow("none_restarts")})
    assert status == 200, body  # queued on rank 0; it fails when it starts, at once, naming the rank
    h = wait_done(front["urls"][0], body["prompt_id"], timeout=180)
    assert h["status"]["status_str"] == "error", h["status"]
    assert_within(time.monotonic() - t0, 30, "the prompt failing for a follower nobody restarts")  # not the 120 s wait for one
    message = error_text(h)
    assert "rank 1 (http://127.0.0.1:" in message and "is not reachable" in message, message
    res = subprocess.run(
        [os.path.join(ROOT, "scripts", "start-tp2.sh"), "restart", "--run-dir", str(front["run"]), "--rank", "1"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0 and "its supervisor had stopped" in res.stdout, res.stdout + res.stderr
    status = subprocess.run(
        [os.path.join(ROOT, "scripts", "start-tp2.sh"), "status", "--run-dir", str(front["run"])], capture_output=True, text=True
    )
    assert "rank 1: up" in status.stdout, status.stdout
    status, body = call(front["urls"][0], "/prompt", {"prompt": workflow("back")})
    assert status == 200, body
    for u in front["urls"]:
        h = wait_done(u, body["prompt_id"])
        assert h["status"]["status_str"] == "success", (u, h["status"]["messages"][-1:])
    assert outputs(front, 0, "back") == outputs(front, 1, "back")


def test_an_interrupt_while_rank0_hands_a_prompt_over_ends_it_on_every_rank(front):
    """Rank 0 holds a prompt while a killed follower is started again; an interrupt then (ComfyUI would clear it as
    the prompt starts) ends the prompt on rank 0 as interrupted, it never reaches the follower, and the next prompt
    runs on both."""
    pid1 = int((front["run"] / "pids").read_text().split("\n")[1].split()[1])
    log0 = front["run"] / "rank0.log"
    waits_before = log0.read_text().count("not reachable while the launcher starts them again")
    os.killpg(pid1, signal.SIGKILL)
    time.sleep(0.3)
    status, body = call(front["urls"][0], "/prompt", {"prompt": workflow("handover_interrupt", seed=3)})
    assert status == 200, body
    deadline = time.monotonic() + 30
    while log0.read_text().count("not reachable while the launcher starts them again") == waits_before:
        assert time.monotonic() < deadline, "rank 0 never held the prompt for the restarting follower"
        time.sleep(0.1)
    call(front["urls"][0], "/interrupt", {})
    h0 = wait_done(front["urls"][0], body["prompt_id"], timeout=30)
    assert h0["status"]["status_str"] == "error" and any(k == "execution_interrupted" for k, _ in h0["status"]["messages"]), h0["status"]
    status, after = call(front["urls"][0], "/prompt", {"prompt": workflow("after_handover_interrupt")})
    for u in front["urls"]:
        assert wait_done(u, after["prompt_id"], timeout=150)["status"]["status_str"] == "success"
    assert call(front["urls"][1], f"/history/{body['prompt_id']}")[1] == {}, "the interrupted prompt reached the follower"
    assert outputs(front, 0, "after_handover_interrupt") == outputs(front, 1, "after_handover_interrupt") != {}


def test_restart_a_rank_by_hand_then_next_prompt_works(front):
    old = int((front["run"] / "pids").read_text().split("\n")[1].split()[1])
    res = subprocess.run(
        [os.path.join(ROOT, "scripts", "start-tp2.sh"), "restart", "--run-dir", str(front["run"]), "--rank", "1"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0 and "rank 1: up again" in res.stdout, res.stdout + res.stderr
    new = int((front["run"] / "pids").read_text().split("\n")[1].split()[1])
    assert new != old
    notes = (front["run"] / "rank1.restarts").read_text()
    assert "restarted by hand" in notes and f"(pid {old}) exited" not in notes, notes  # not counted as a crash
    status, body = call(front["urls"][0], "/prompt", {"prompt": workflow("by_hand")})
    for u in front["urls"]:
        assert wait_done(u, body["prompt_id"])["status"]["status_str"] == "success"
    assert outputs(front, 0, "by_hand") == outputs(front, 1, "by_hand") != {}


def test_a_forged_future_order_costs_no_prompt_and_a_malformed_one_is_refused(front):
    """An order with the secret and rank 0's boot id (a local process that read the secret file and the rank store)
    but a count rank 0 never reached: the follower takes it (it carries the secret), refuses rank 0's next order as out
    of order and moves its mark back to rank 0's count; rank 0 hands it over again, so both prompts after run on both
    ranks, identical."""
    import re
    import uuid
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = int(re.search(r"MASTER_PORT=\"?(\d+)", (front["run"] / "launch.env").read_text())[1])
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    boot = store.get("tp2/boot/rank0").decode()
    secret = {"X-TP2-Secret": front["secret"]}
    malformed = {"prompt": workflow("malformed"), "prompt_id": str(uuid.uuid4()), "tp2": {"run": "x", "seq": "9", "boot": boot}}
    assert call(front["urls"][1], "/prompt", malformed, secret)[0] == 403
    order = {"run": "forged", "seq": 10**9, "boot": boot, "reset": False}
    forged = {"prompt": workflow("forged", steps=1), "prompt_id": str(uuid.uuid4()), "tp2": order}
    status, body = call(front["urls"][1], "/prompt", forged, secret)
    assert status == 200, body
    wait_done(front["urls"][1], forged["prompt_id"], timeout=60)  # alone on the follower: no rank 0 meets it; it fails there
    ids = [call(front["urls"][0], "/prompt", {"prompt": workflow(f"after_forged{i}")})[1]["prompt_id"] for i in range(2)]
    for i, prompt_id in enumerate(ids):
        hs = [wait_done(u, prompt_id, timeout=90) for u in front["urls"]]
        assert all(h["status"]["status_str"] == "success" for h in hs), [error_text(h) for h in hs]
        a, b = outputs(front, 0, f"after_forged{i}"), outputs(front, 1, f"after_forged{i}")
        assert len(a) == 2 and a == b


def _restart_rank0(front) -> None:
    res = subprocess.run(
        [os.path.join(ROOT, "scripts", "start-tp2.sh"), "restart", "--run-dir", str(front["run"]), "--rank", "0"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0 and "rank 0: up again" in res.stdout, res.stdout + res.stderr


def _journal_line(front, row: list, sign: bool = True) -> str:
    from tp2.signing import signed

    text = json.dumps(row)
    return (signed(front["secret"], "tp2/queue_journal", text) if sign else f"{text}|{'0' * 32}") + "\n"


def test_a_damaged_queue_journal_fails_what_it_cannot_run_and_the_pack_still_loads(front):
    """Rank 0 restarted over a journal holding, after the real one (with the record of a prompt that finished before):
    a signed pending prompt, an injected unsigned one, a signed entry of the wrong shape, the prompt that was running,
    and a line cut short (issue 39: a wrong shape disabled the pack; a cut file dropped its prompts without a word).
    The finished prompt's record survives, the pending prompt runs on both ranks, each of the others gets a failed
    record naming why, the file is moved aside, and the journal rank 0 writes next is readable by this user only."""
    import uuid

    journal = front["run"] / "rank0.queue.json"
    done = call(front["urls"][0], "/prompt", {"prompt": workflow("before_restart")})[1]["prompt_id"]
    assert wait_done(front["urls"][0], done)["status"]["status_str"] == "success"
    assert oct(journal.stat().st_mode & 0o777) == "0o600"
    ids = {k: str(uuid.uuid4()) for k in ("pending", "unsigned", "shape", "running", "cut")}
    cut = _journal_line(front, ["pending", 104, ids["cut"], workflow("cut"), {}, ["7", "8"]])
    journal.write_text(
        journal.read_text()
        + _journal_line(front, ["pending", 100, ids["pending"], workflow("from_journal"), {}, ["7", "8"]])
        + _journal_line(front, ["pending", 101, ids["unsigned"], workflow("injected"), {}, ["7", "8"]], sign=False)
        + _journal_line(front, ["pending", 102, ids["shape"], "not a prompt", {}, ["7", "8"]])
        + _journal_line(front, ["running", 103, ids["running"], workflow("was_running"), {}, ["7", "8"]])
        + cut[: len(cut) // 2]
    )
    _restart_rank0(front)
    assert call(front["urls"][0], f"/history/{done}")[1][done]["status"]["status_str"] == "success"
    for u in front["urls"]:
        assert wait_done(u, ids["pending"], timeout=90)["status"]["status_str"] == "success"
    assert outputs(front, 0, "from_journal") == outputs(front, 1, "from_journal") != {}
    expected = {
        "unsigned": "its signature does not verify: rank 0 of this run did not write it",
        "shape": "an entry of a shape the pack does not write",
        "running": "rank 0's process ended while this prompt ran",
        "cut": "not a journal entry (cut short, or not written by the pack)",
    }
    for key, why in expected.items():
        h = wait_done(front["urls"][0], ids[key], timeout=10)
        assert h["status"]["status_str"] == "error" and why in error_text(h), (key, error_text(h))
    assert outputs(front, 0, "injected") == {} and outputs(front, 1, "injected") == {}
    assert len(list(front["run"].glob("rank0.queue.json.unreadable-*"))) == 1
    assert "the queue journal" in (front["run"] / "rank0.log").read_text()
    assert oct(journal.stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("content", ["[]", "", '{"running": [], "pending": [[1]]}'], ids=["list", "empty", "old_shape"])
def test_a_journal_of_another_shape_never_disables_the_pack(front, content):
    """`[]` in the journal made the pack fail to load on the restarted rank 0 ("list index out of range"), so every H3
    prompt was refused (issue 39). Whatever it holds, rank 0 comes back with the pack and runs an H3 prompt."""
    (front["run"] / "rank0.queue.json").write_text(content)
    _restart_rank0(front)
    status, body = call(front["urls"][0], "/prompt", {"prompt": workflow(f"after_{len(content)}")})
    assert status == 200, body
    for u in front["urls"]:
        assert wait_done(u, body["prompt_id"], timeout=90)["status"]["status_str"] == "success"
