"""Ctrl-C on scripts/start-tp2.sh while its ranks start (issue 49): the launcher stops the ranks it started (their
supervisors and process groups), names each, and exits 130; nothing of that start is left running or holding a port.
Before, it exited silently and both ranks went on starting in the background."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from comfy_harness import COMFYUI_DIR, ROOT, free_port, have_comfyui, tiny_base

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the ranks bind: TIME-WAIT does not count
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _of_this_run(run_dir) -> list[int]:
    """Processes whose command line names the run folder (the ranks' --output-directory is under it), but not pgrep."""
    found = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found if _alive(int(p))]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "term"])
def test_interrupted_start_stops_the_ranks_it_started_and_names_them(tmp_path, sig):
    base, run_dir, port = tiny_base(tmp_path), tmp_path / "ranks", free_port()
    cmd = [os.path.join(ROOT, "scripts", "start-tp2.sh"), "--comfyui", COMFYUI_DIR, "--tp-size", "2", "--cpu", "--run-dir", str(run_dir),
           "--base-dir", base, "--base-port", str(port), "--", "--disable-api-nodes"]  # fmt: skip
    # its own session: SIGINT goes to the launcher's whole process group, as a terminal's Ctrl-C does
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHON=sys.executable), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    pids_file = run_dir / "pids"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        lines = pids_file.read_text().split() if pids_file.exists() else []
        if len(lines) == 6:  # both ranks' processes exist; ComfyUI takes far longer than this to answer on a CPU
            break
        time.sleep(0.1)
    time.sleep(1.0)
    assert proc.poll() is None, "the launcher ended before it could be interrupted:\n" + proc.communicate()[1]
    ranks = [(int(r), int(p), int(q)) for r, p, q in zip(*[iter(pids_file.read_text().split())] * 3)]
    assert [q for _, _, q in ranks] == [port, port + 1] and all(_alive(p) for _, p, _ in ranks), ranks
    supervisors = [int((run_dir / f"rank{r}.supervisor").read_text()) for r in (0, 1)]
    (os.killpg if sig == signal.SIGINT else os.kill)(proc.pid, sig)  # TERM: to the launcher alone, as `kill PID` does
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=90)
    took = time.monotonic() - t0
    assert proc.returncode == 130, out + err
    named = ", ".join(f"rank {r} (pid {p}, port {q})" for r, p, q in ranks)
    assert f"start-tp2: interrupted while the ranks started: stopping {named}" in err, err
    assert f"stopped the ranks of {run_dir}" in err and "ready." not in out, out + err
    assert not [p for _, p, _ in ranks if _alive(p)] and not [p for p in supervisors if _alive(p)], (ranks, supervisors, took)
    assert _bindable(port) and _bindable(port + 1)
    time.sleep(3.0)  # long enough for a supervisor that survived to start its rank again
    assert not _of_this_run(run_dir), subprocess.run(["ps", "-o", "pid,args", "-p", ",".join(map(str, _of_this_run(run_dir)))],
                                                     capture_output=True, text=True).stdout  # fmt: skip
    assert not pids_file.exists(), os.listdir(run_dir)
