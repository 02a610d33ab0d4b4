"""A rank the kernel's out-of-memory killer ends, on real ComfyUI ranks from scripts/start-tp2.sh: rank 1 is moved into
a memory cgroup whose limit a 1024x1024 prompt's allocations cross, so the kernel's OOM killer (not the test) ends it.
Rank 0 (a prompt queued on its front door), `start-tp2.sh status` and tp2-submit must name the OOM killer and what to
do; the launcher starts rank 1 again, and the next prompt runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from comfy_harness import COMFYUI_DIR, ROOT, call, error_text, have_comfyui, launch, stop_launched, tiny_base, wait_answers, wait_done

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

SCRIPTS = os.path.join(ROOT, "scripts")
TINY = os.path.join(ROOT, "workflows", "api", "h3_tp2_tiny_demo.json")


def memory_cgroup() -> str | None:
    """A new memory cgroup (v1) under this process's own, or None where this machine does not let us make one."""
    own = next((line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup") if line.split(":")[1] == "memory"), None)
    if own is None:
        return None
    path = os.path.join("/sys/fs/cgroup/memory", own.lstrip("/"), f"tp2test{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(1 << 30))
        return path
    except OSError:
        return None


def oom_rank1(launched: dict, cgroup: str) -> None:
    """Move rank 1 (as running now) into `cgroup`, limited to what it holds plus 64 MiB: idle it stays under, the
    1024x1024 prompt's activations and frames do not, so the kernel's OOM killer ends it mid-prompt."""
    wait_answers(launched["urls"][1])
    pid1 = int(open(os.path.join(launched["run_dir"], "pids")).read().split("\n")[1].split()[1])
    with open(os.path.join(cgroup, "memory.limit_in_bytes"), "w") as f:
        f.write(str(1 << 30))
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(pid1))  # from now on what rank 1 allocates is charged here
    usage = int(open(os.path.join(cgroup, "memory.usage_in_bytes")).read())
    with open(os.path.join(cgroup, "memory.limit_in_bytes"), "w") as f:
        f.write(str(usage + (64 << 20)))


def test_a_rank_ended_by_the_oom_killer_is_named_as_such(tmp_path):
    cgroup = memory_cgroup()
    if cgroup is None:
        pytest.skip("no writable memory cgroup (v1) here: the kernel's OOM killer cannot be made to act on one rank")
    base = tiny_base(tmp_path)
    launched = launch(tmp_path, base, {"TP2_PROMPT_TIMEOUT_S": "15", "TP2_TIMEOUT_S": "20"})
    wf = json.load(open(TINY))
    wf["4"]["inputs"].update(width=1024, height=1024)
    try:
        oom_rank1(launched, cgroup)  # queued on rank 0's front door, as the web UI does: rank 0's own account
        status, body = call(launched["urls"][0], "/prompt", {"prompt": wf, "client_id": "oom-test"})
        assert status == 200, body
        err = error_text(wait_done(launched["urls"][0], body["prompt_id"], timeout=120))
        assert "rank 1 ended" in err and "out-of-memory killer ended a process on this machine during this prompt" in err, err
        status = subprocess.run([os.path.join(SCRIPTS, "start-tp2.sh"), "status", "--run-dir", launched["run_dir"]],
                                capture_output=True, text=True)  # fmt: skip
        assert "rank 1:" in status.stdout and "killed by the kernel's out-of-memory killer" in status.stdout, status.stdout

        oom_rank1(launched, cgroup)  # the restarted rank 1, through the client
        path = tmp_path / "big.json"
        path.write_text(json.dumps(wf))
        cmd = [sys.executable, os.path.join(SCRIPTS, "tp2-submit"), str(path), "--ports", ",".join(map(str, launched["ports"])),
               "--quiet", "--out", str(tmp_path / "out")]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert run.returncode == 1 and "out-of-memory killer" in run.stderr and "host memory the ranks need" in run.stderr, run.stderr
    finally:
        stop = stop_launched(launched)
        for pid in open(os.path.join(cgroup, "cgroup.procs")).read().split():  # none left: a restarted rank is not in it
            subprocess.run(["kill", "-9", pid])
        os.rmdir(cgroup)
    assert stop.returncode == 0, stop.stderr
