"""A rank alive but stuck, through scripts/start-tp2.sh and rank 0's front door (CPU, gloo, the tiny int8 model), with
the fault seam (TP2_TEST_FAULT_FILE `hang`: alive, no progress until the run stops). The waiting rank says on whom it
waits, then the prompt fails on every rank naming the stuck rank and where, the stuck rank's stacks go to its log,
and the next prompt succeeds; a rank 5 s late is no stall. TP2_STALL_S is 12 s here (the default is a minute or more)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from comfy_harness import COMFYUI_DIR, call, error_text, have_comfyui, launch, stop_launched, tiny_base, wait_done
from comfy_harness import demo_workflow as workflow

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

STALL_S = 12.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    run = tmp_path_factory.mktemp("stalls")
    env = {"TP2_PROMPT_TIMEOUT_S": "15", "TP2_TIMEOUT_S": "120", "TP2_STALL_S": str(STALL_S), "TP2_TEST_FAULT_FILE": str(run / "fault")}
    launched = launch(run, tiny_base(run), env)
    yield dict(launched, fault=run / "fault", run=Path(launched["run_dir"]))
    stop_launched(launched)


def run_with_fault(ranks, fault: str, prefix: str, steps: int = 8) -> tuple[list[dict], float]:
    ranks["fault"].write_text(fault)
    status, body = call(ranks["urls"][0], "/prompt", {"prompt": workflow(prefix, steps, 145)})
    assert status == 200, body
    t0 = time.monotonic()
    done = [wait_done(u, body["prompt_id"], timeout=150) for u in ranks["urls"]]
    return done, time.monotonic() - t0


def next_prompt_succeeds(ranks, prefix: str) -> None:
    status, body = call(ranks["urls"][0], "/prompt", {"prompt": workflow(prefix, 2, 7)})
    assert status == 200, body
    assert all(wait_done(u, body["prompt_id"], timeout=120)["status"]["status_str"] == "success" for u in ranks["urls"])


@pytest.mark.parametrize(
    "stuck,call,where",
    [(1, "5", "in sampler1 at unit 5"), (1, "0", "between TP steps"), (0, "5", "in sampler1 at unit 5")],
    ids=["follower-call5", "follower-sampler", "rank0-call5"],
)
def test_a_stuck_rank_is_named_and_the_prompt_fails_on_every_rank(ranks, stuck, call, where):
    log = ranks["run"] / f"rank{1 - stuck}.log"
    before = len(log.read_bytes())
    done, took = run_with_fault(ranks, f"{stuck}:{call}:hang", f"stuck{stuck}_{call}")
    for h in done:
        assert h["status"]["status_str"] == "error", error_text(h)
        assert f"rank {stuck} is stuck {where}" in error_text(h) and "TP2_STALL_S" in error_text(h), error_text(h)
    waited = log.read_bytes()[before:].decode(errors="replace")
    assert f"waiting for rank {stuck} at " in waited, waited[-3000:]
    assert "Python stacks follow" in (ranks["run"] / f"rank{stuck}.log").read_text(errors="replace")
    print(f"\n[stall] rank {stuck} hung at {call}: failed on every rank {took:.1f} s after queueing (limit {STALL_S:.0f} s)")
    assert took < STALL_S + 45
    next_prompt_succeeds(ranks, f"after_stuck{stuck}_{call}")


def test_a_rank_5_s_late_is_no_stall(ranks):
    done, took = run_with_fault(ranks, "1:5:sleep", "late")
    assert all(h["status"]["status_str"] == "success" for h in done), [error_text(h) for h in done]
    print(f"\n[stall] rank 1 5 s late at call 5: succeeded in {took:.1f} s")
