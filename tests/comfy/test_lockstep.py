"""Lockstep that cannot drift, on real ComfyUI servers started by scripts/start-tp2.sh (CPU, gloo, the tiny int8
model): one queue on rank 0, a rank's failure reaches every rank in seconds with its reason, a frozen or killed
rank is named, and each case ends with the next prompt succeeding on every rank with byte-identical outputs.

Faults are injected through TP2_TEST_FAULT_FILE (fixtures/tp2_seams; inert unless that file exists)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from comfy_harness import (
    COMFYUI_DIR,
    call,
    error_text,
    free_port,
    have_comfyui,
    launch,
    stop_launched,
    tiny_base,
    wait_answers,
    wait_done,
)  # fmt: skip
from comfy_harness import demo_workflow as workflow
from conftest import assert_within

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    run = tmp_path_factory.mktemp("lockstep")
    fault = run / "fault"
    (run / "ranks").mkdir()
    (run / "ranks" / "secret").write_text("an old secret that others could read\n")
    os.chmod(run / "ranks" / "secret", 0o644)
    master_port = free_port()  # chosen by the user: the launcher must use it
    env = {"TP2_PROMPT_TIMEOUT_S": "15", "TP2_TIMEOUT_S": "120", "TP2_TEST_FAULT_FILE": str(fault), "MASTER_PORT": str(master_port)}
    launched = launch(run, tiny_base(run), env)
    run_dir = Path(launched["run_dir"])
    yield {"urls": launched["urls"], "run": run_dir, "secret": (run_dir / "secret").read_text().strip(), "fault": fault,
           "master_port": master_port}  # fmt: skip
    stop_launched(launched)


def queue(ranks, prefix: str, steps: int = 3, seed: int = 145, **extra) -> str:
    status, body = call(ranks["urls"][0], "/prompt", {"prompt": workflow(prefix, steps, seed), **extra})
    assert status == 200, body
    return body["prompt_id"]


def outputs(ranks, rank: int, prefix: str) -> dict[str, bytes]:
    d = ranks["run"] / f"rank{rank}" / "output" / "latents"
    return {f.name: f.read_bytes() for f in sorted(d.glob(f"{prefix}_*"))} if d.exists() else {}


def assert_next_prompt_identical(ranks, prefix: str) -> None:
    """The closing check of every case: a new prompt succeeds on every rank with byte-identical outputs."""
    pid = queue(ranks, prefix, seed=7)
    for u in ranks["urls"]:
        h = wait_done(u, pid)
        assert h["status"]["status_str"] == "success", (u, error_text(h))
    a, b = outputs(ranks, 0, prefix), outputs(ranks, 1, prefix)
    assert len(a) == 2 and a == b


def kill_mid_prompt(ranks, rank: int, prefix: str, pending: int, seed: int) -> tuple[str, dict[str, str], float]:
    """A long prompt running on every rank with `pending` more queued behind it (seeds seed, seed + 1, ...), then
    rank `rank`'s process group SIGKILLed: (the running prompt's id, output prefix -> pending prompt id, when)."""
    victim = rank_pids(ranks)[rank]
    running = queue(ranks, prefix, steps=400)
    queued = {f"{prefix}_pending{i}": queue(ranks, f"{prefix}_pending{i}", seed=seed + i) for i in range(pending)}
    running_on(ranks["urls"][1], running)
    time.sleep(1.0)
    os.killpg(victim, signal.SIGKILL)
    return running, queued, time.monotonic()


def assert_all_identical(ranks, prompts: dict[str, str], timeout: float = 180) -> None:
    """Every prompt of `prompts` (prefix -> id) succeeded on every rank with byte-identical outputs."""
    for prefix, prompt_id in prompts.items():
        for u in ranks["urls"]:
            h = wait_done(u, prompt_id, timeout=timeout)
            assert h["status"]["status_str"] == "success", (u, prefix, error_text(h))
        a, b = outputs(ranks, 0, prefix), outputs(ranks, 1, prefix)
        assert len(a) == 2 and a == b, prefix


def running_on(url: str, prompt_id: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(item[1] == prompt_id for item in call(url, "/queue")[1]["queue_running"]):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{prompt_id} never ran on {url}")


def rank_pids(ranks) -> dict[int, int]:
    lines = (ranks["run"] / "pids").read_text().split("\n")
    return {int(line.split()[0]): int(line.split()[1]) for line in lines if line.strip()}


def test_the_users_master_port_on_loopback_only_and_a_fresh_private_secret(ranks):
    first = queue(ranks, "port_check")
    assert wait_done(ranks["urls"][0], first)["status"]["status_str"] == "success"
    lines = [ln.split()[3] for ln in subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout.splitlines()[1:]]
    listening = [a for a in lines if a.rsplit(":", 1)[-1] == str(ranks["master_port"])]
    assert listening == [f"127.0.0.1:{ranks['master_port']}"], listening
    secret = ranks["run"] / "secret"
    assert oct(secret.stat().st_mode & 0o777) == "0o600" and len(ranks["secret"]) == 64


def test_cancel_of_pending_jobs_by_id_and_batch_costs_only_those_jobs(ranks):
    running = queue(ranks, "cancel_running", steps=60)
    running_on(ranks["urls"][0], running)
    by_id, kept, by_batch = queue(ranks, "cancel_by_id"), queue(ranks, "cancel_kept"), queue(ranks, "cancel_by_batch")
    assert call(ranks["urls"][0], f"/api/jobs/{by_id}/cancel", {})[1] == {"cancelled": True}
    assert call(ranks["urls"][0], "/api/jobs/cancel", {"job_ids": [by_batch]})[1] == {"cancelled": True}
    for pid in (running, kept):
        for u in ranks["urls"]:
            h = wait_done(u, pid)
            assert h["status"]["status_str"] == "success", (u, error_text(h))
    for pid in (by_id, by_batch):
        for u in ranks["urls"]:
            assert call(u, f"/history/{pid}")[1] == {}, (u, pid)  # never ran anywhere
    assert outputs(ranks, 0, "cancel_kept") == outputs(ranks, 1, "cancel_kept") != {}
    assert_next_prompt_identical(ranks, "after_cancel")


def test_free_on_rank0_then_the_same_workflow_succeeds(ranks):
    first = queue(ranks, "freed")
    for u in ranks["urls"]:
        assert wait_done(u, first)["status"]["status_str"] == "success"
    assert call(ranks["urls"][0], "/free", {"unload_models": True, "free_memory": True})[0] == 200
    time.sleep(1.5)  # the prompt worker applies the flags when idle
    again = queue(ranks, "freed")  # the same workflow: rank 0 recomputes, so must every rank
    for u in ranks["urls"]:
        h = wait_done(u, again)
        assert h["status"]["status_str"] == "success", (u, error_text(h))
    assert_next_prompt_identical(ranks, "after_free")


@pytest.mark.parametrize(
    "path,body",
    [
        ("/prompt", {"prompt": {}}),
        ("/api/prompt", {"prompt": {}}),
        ("/queue", {"clear": True}),
        ("/interrupt", {}),
        ("/api/interrupt", {}),
        (f"/api/jobs/{uuid.uuid4()}/cancel", {}),
        ("/api/jobs/cancel", {"job_ids": [str(uuid.uuid4())]}),
        ("/free", {"unload_models": True}),
        ("/history", {"clear": True}),
    ],
)
def test_control_routes_on_a_follower_refuse_without_the_secret(ranks, path, body):
    status, answer = call(ranks["urls"][1], path, body)
    assert status == 403, (path, status, answer)
    assert ranks["urls"][0] in answer["error"]["message"]  # says where to go


def test_two_clients_posting_large_bodies_at_once_run_in_one_order_everywhere(ranks):
    padding = "x" * (8 * 1024 * 1024)  # the web UI sends the whole canvas; here an extra_data key no node saves
    ids: list[str] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        for i in range(10):
            body = {"prompt": workflow(f"many_{n}_{i}", steps=2, seed=n * 100 + i), "extra_data": {"tp2_test_padding": padding}}
            status, answer = call(ranks["urls"][0], "/prompt", body, timeout=120)
            assert status == 200, answer
            with lock:
                ids.append(answer["prompt_id"])

    threads = [threading.Thread(target=client, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 20
    for u in ranks["urls"]:
        for pid in ids:
            h = wait_done(u, pid, timeout=180)
            assert h["status"]["status_str"] == "success", (u, error_text(h))
    orders = [[pid for pid in call(u, "/history")[1] if pid in ids] for u in ranks["urls"]]
    assert orders[0] == orders[1] and len(orders[0]) == 20
    for n in range(2):
        for i in range(10):
            assert outputs(ranks, 0, f"many_{n}_{i}") == outputs(ranks, 1, f"many_{n}_{i}") != {}


@pytest.mark.parametrize(
    "fault,expect",
    [
        ("1:5:error", ["rank 1 failed at step", "injected fault at model call 5"]),
        ("1:5:oom", ["rank 1 ran out of GPU memory at step", "CUDA out of memory", "use fewer frames, a lower resolution or more ranks"]),
    ],
)
def test_exception_on_rank1_mid_sampling_fails_rank0_within_seconds_with_its_reason(ranks, fault, expect):
    ranks["fault"].write_text(fault)
    pid = queue(ranks, "fault_" + fault.split(":")[2], steps=20)
    h1 = wait_done(ranks["urls"][1], pid, timeout=180)
    t1 = time.monotonic()
    h0 = wait_done(ranks["urls"][0], pid, timeout=180)  # else the 120 s collective timeout (TP2_TIMEOUT_S)
    assert_within(time.monotonic() - t1, 10, "rank 0's failure after rank 1's")
    assert h0["status"]["status_str"] == "error" and h1["status"]["status_str"] == "error"
    message = error_text(h0)
    for text in expect:
        assert text in message, message
    assert "ended: it closed its connection" not in message and "failed or died" not in message  # the real reason, not the loss
    assert not ranks["fault"].exists()
    assert_next_prompt_identical(ranks, "after_" + fault.split(":")[2])


def test_failure_on_rank0_before_the_sampler_releases_the_follower_within_seconds(ranks):
    ranks["fault"].write_text("0:0:error")
    pid = queue(ranks, "rank0_early")
    h0 = wait_done(ranks["urls"][0], pid, timeout=180)
    t0 = time.monotonic()
    h1 = wait_done(ranks["urls"][1], pid, timeout=180)
    assert_within(time.monotonic() - t0, 10, "the follower's release after rank 0's failure")
    assert h0["status"]["status_str"] == "error" and h1["status"]["status_str"] == "error"
    assert "rank 0" in error_text(h1) and "injected fault" in error_text(h1), error_text(h1)
    assert_next_prompt_identical(ranks, "after_rank0_early")


def test_interrupt_while_a_follower_is_late_at_the_rendezvous_and_a_reused_prompt_id(ranks):
    ranks["fault"].write_text("1:0:sleep")  # rank 1 reaches the sampler 5 s late
    pid = queue(ranks, "late")
    running_on(ranks["urls"][0], pid)
    time.sleep(1.5)  # rank 0 now waits at the sampler rendezvous
    t0 = time.monotonic()
    call(ranks["urls"][0], "/interrupt", {})
    waits = []
    for u in ranks["urls"]:
        h = wait_done(u, pid, timeout=180)
        waits.append(time.monotonic() - t0)
        assert h["status"]["status_str"] == "error", h["status"]
        assert "did not reach" not in error_text(h), error_text(h)  # stopped by the interrupt, not by the rendezvous timeout
    assert_within(max(waits), 10, f"the interrupt reaching every rank ({waits})")
    status, answer = call(ranks["urls"][0], "/prompt", {"prompt": workflow("reused"), "prompt_id": pid})
    assert status == 409 and "used once" in answer["error"]["message"], answer
    assert_next_prompt_identical(ranks, "after_late")


def test_frozen_follower_is_named_within_20_s_and_recovers_after_sigcont(ranks):
    """15 s of silence, then the next poll: 15.7-17.1 s measured on an idle CPU machine; 20, scaled by the load."""
    follower = rank_pids(ranks)[1]
    pid = queue(ranks, "frozen", steps=400)
    running_on(ranks["urls"][1], pid)
    time.sleep(1.0)
    os.killpg(follower, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        h0 = wait_done(ranks["urls"][0], pid, timeout=180)
        waited = time.monotonic() - t0
    finally:
        os.killpg(follower, signal.SIGCONT)
    assert_within(waited, 20, "naming the frozen follower")  # else the 120 s collective timeout; the message says which
    assert h0["status"]["status_str"] == "error" and "rank 1 is not responding" in error_text(h0), error_text(h0)
    assert wait_done(ranks["urls"][1], pid, timeout=30)["status"]["status_str"] == "error"
    assert_next_prompt_identical(ranks, "after_frozen")


def test_rank0_killed_mid_sampling_follower_reports_within_10_s_then_rank0_restarts_and_runs_its_queue(ranks):
    """Rank 0 killed with 5 prompts pending: the follower names it within 10 s; the launcher starts rank 0 again,
    which records the prompt that was running as failed with the reason and runs the 5, identical on both ranks."""
    pid0 = rank_pids(ranks)[0]
    pid, pending, t0 = kill_mid_prompt(ranks, 0, "kill0", 5, seed=100)
    h1 = wait_done(ranks["urls"][1], pid, timeout=180)
    assert_within(time.monotonic() - t0, 10, "the follower naming rank 0's death")
    assert h1["status"]["status_str"] == "error" and "rank 0 died" in error_text(h1), error_text(h1)
    deadline = time.monotonic() + 90  # the launcher starts rank 0 again
    while rank_pids(ranks)[0] == pid0 and time.monotonic() < deadline:
        time.sleep(0.5)
    wait_answers(ranks["urls"][0])
    h0 = wait_done(ranks["urls"][0], pid, timeout=60)
    assert h0["status"]["status_str"] == "error" and "rank 0's process ended while this prompt ran" in error_text(h0), error_text(h0)
    assert_all_identical(ranks, pending)
    assert_next_prompt_identical(ranks, "after_kill0")


def test_a_killed_follower_costs_only_the_running_prompt(ranks):
    """A follower killed with 10 prompts pending: the running prompt fails on rank 0 within 5 s naming rank 1; rank 0
    holds the queue while the launcher starts the follower again, then runs the 10, identical on both ranks."""
    pid, pending, t0 = kill_mid_prompt(ranks, 1, "kill1", 10, seed=200)
    h0 = wait_done(ranks["urls"][0], pid, timeout=180)
    assert_within(time.monotonic() - t0, 5, f"rank 0 naming the killed follower ({error_text(h0)})")
    assert h0["status"]["status_str"] == "error" and "rank 1 ended" in error_text(h0), error_text(h0)
    wait_answers(ranks["urls"][1])
    assert_all_identical(ranks, pending)


def ends_alike(ranks, prompt_id: str, prefix: str) -> str:
    """How prompt `prompt_id` ended on rank 0 ('success' or 'error'), asserted the same on the follower: success with
    byte-identical outputs, or a failure (a follower rank 0 never handed it to has none: it never ran there)."""
    h0 = wait_done(ranks["urls"][0], prompt_id, timeout=60)
    status = h0["status"]["status_str"]
    on_follower = call(ranks["urls"][1], f"/history/{prompt_id}")[1] or any(
        item[1] == prompt_id for part in call(ranks["urls"][1], "/queue")[1].values() for item in part
    )  # rank 0 records a prompt after its hand-over ended: by now the follower has it, or never will
    if status == "success" or on_follower:
        h1 = wait_done(ranks["urls"][1], prompt_id, timeout=60)
        assert h1["status"]["status_str"] == status, (prefix, status, error_text(h0), error_text(h1))
    if status == "success":
        a, b = outputs(ranks, 0, prefix), outputs(ranks, 1, prefix)
        assert len(a) == 2 and a == b, prefix
    return status


def test_an_interrupt_at_any_moment_of_a_prompt_ends_it_alike_on_every_rank(ranks):
    """24 interrupts on rank 0 at stepped moments of a prompt's life (from as it is queued, through the hand-over, the
    rendezvous, sampling, the nodes after it and the saves, to after its end), every fourth with the prompt queued
    behind another that the interrupt stops: each prompt ends the same way on both ranks, every time."""
    for warm in range(2):  # the second one's length: the model is loaded by then
        t0 = time.monotonic()
        assert ends_alike(ranks, queue(ranks, f"sweep_timing{warm}", steps=4), f"sweep_timing{warm}") == "success"
        span = time.monotonic() - t0
    ends = []
    for i in range(24):
        behind = queue(ranks, f"sweep_blocker{i}", steps=4, seed=500 + i) if i % 4 == 0 else None
        pid = queue(ranks, f"sweep{i}", steps=4, seed=600 + i)
        time.sleep(0.0 if behind else span * 1.2 * i / 23)
        call(ranks["urls"][0], "/interrupt", {})
        if behind:
            ends_alike(ranks, behind, f"sweep_blocker{i}")
        ends.append(ends_alike(ranks, pid, f"sweep{i}"))
    print(f"prompt {span:.1f} s; ends: {ends}")
    assert "success" in ends and "error" in ends, ends  # the sweep reached both sides of the prompt's end
    assert_next_prompt_identical(ranks, "after_sweep")
