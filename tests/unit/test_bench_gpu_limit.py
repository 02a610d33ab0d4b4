"""The benchmarks' small cards and hosts (scripts/bench/process_memory.py): a GPU cap is CUDA MPS's per-client limit, from
a daemon started in its own folders and told to quit with the same ones; without MPS a capped run stops before it starts
anything. This machine has no GPU and no MPS: a stand-in `nvidia-cuda-mps-control` on PATH records how it was called.
The host is held by a child that writes every page of what it holds."""

from __future__ import annotations

import os
import stat
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench")
sys.path.insert(0, BENCH)
import bench_comfy  # noqa: E402
import whole_video  # noqa: E402
from process_memory import MPS, confine_gpus, hold_host, stop_all  # noqa: E402

CONTROL = """#!/bin/sh
echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY stdin=$( [ "$1" = -d ] || cat )" >> "$CALLS"
"""


@pytest.fixture
def control(tmp_path, monkeypatch):
    """A stand-in control daemon first on PATH; returns the file its calls are written to."""
    exe = tmp_path / "bin" / MPS.CONTROL
    exe.parent.mkdir()
    exe.write_text(CONTROL)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls"
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CALLS", str(calls))
    return calls


def test_a_client_limit_is_written_as_mps_reads_it(tmp_path):
    mps = MPS(str(tmp_path))
    assert mps.client_env(22)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=22G"
    assert mps.client_env(21.5)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=22016M"
    assert mps.client_env(22)["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "pipe")


def test_each_process_is_confined_by_mps(control):
    held, env, how = confine_gpus(22)
    assert how == "CUDA MPS: 22 GiB per process" and env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=22G"
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert os.path.isdir(pipe) and os.path.isdir(env["CUDA_MPS_LOG_DIRECTORY"]) and len(pipe) < 60  # socket paths are short
    started = control.read_text().splitlines()
    assert started == [f"args=-d pipe={pipe} log={env['CUDA_MPS_LOG_DIRECTORY']} stdin="]
    stop_all(held)  # the servers' end: the daemon told to quit, in its own folders
    assert control.read_text().splitlines()[1] == f"args= pipe={pipe} log={env['CUDA_MPS_LOG_DIRECTORY']} stdin=quit"


def _no_mps(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-cuda-mps-control on it


def test_without_mps_a_cap_stops_at_once(tmp_path, monkeypatch):
    _no_mps(monkeypatch, tmp_path)
    with pytest.raises(SystemExit, match=r"a GPU cap needs CUDA MPS \(nvidia-cuda-mps-control .*\): run without the cap"):
        confine_gpus(22)
    base, dirs = tmp_path / "base", ["--comfyui", str(tmp_path), "--front-end", str(tmp_path), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="a GPU cap needs CUDA MPS"):
        bench_comfy.main(["--base", str(base), *dirs, "--cap-gib", "22"])
    with pytest.raises(SystemExit, match="a GPU cap needs CUDA MPS"):
        whole_video.main(["--base", str(base), *dirs, "--configs", "tp1,tp2@22", "--commit", "test"])
    assert not base.exists() and not (tmp_path / "out").exists()  # nothing linked, made or started


def test_the_host_is_held_by_a_child_until_it_is_stopped(capfd):
    p = hold_host(0.5)
    try:
        assert capfd.readouterr().out.startswith("host: held 0.5 GiB, available ")
        with open(f"/proc/{p.pid}/status") as f:
            anon_kib = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
        assert anon_kib >= 0.5 * 2**20  # every page written: resident, not the shared zero page
    finally:
        stop_all([p])
    assert p.returncode is not None
