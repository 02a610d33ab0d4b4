"""The one-GPU mode's per-rank limit (scripts/bench/process_memory.py confine_gpus): ranks sharing a GPU each get CUDA
MPS's per-client limit, from a daemon started in its own folders and told to quit with the same ones; ranks on GPUs of
their own, or a probe that found MPS not limiting (TP2_BENCH_GPU_LIMIT=ballast), get the ballast instead. This machine
has no GPU and no MPS: a stand-in `nvidia-cuda-mps-control` on PATH records how it was called."""

from __future__ import annotations

import os
import stat
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench"))
from process_memory import MPS, confine_gpus, stop_all  # noqa: E402

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
    monkeypatch.delenv("TP2_BENCH_GPU_LIMIT", raising=False)
    return calls


def test_a_client_limit_is_written_as_mps_reads_it(tmp_path):
    mps = MPS(str(tmp_path))
    assert mps.client_env(22)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=22G"
    assert mps.client_env(21.5, device=1)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "1=22016M"
    assert mps.client_env(22)["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "pipe")


def test_ranks_sharing_a_gpu_are_each_confined_by_mps(control):
    held, env, how = confine_gpus(22, {0: 2})
    assert how == "CUDA MPS: 22 GiB per process" and env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=22G"
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert os.path.isdir(pipe) and os.path.isdir(env["CUDA_MPS_LOG_DIRECTORY"]) and len(pipe) < 60  # socket paths are short
    started = control.read_text().splitlines()
    assert started == [f"args=-d pipe={pipe} log={env['CUDA_MPS_LOG_DIRECTORY']} stdin="]
    stop_all(held)  # the servers' end: the daemon told to quit, in its own folders
    assert control.read_text().splitlines()[1] == f"args= pipe={pipe} log={env['CUDA_MPS_LOG_DIRECTORY']} stdin=quit"


@pytest.mark.parametrize("per_gpu, env", [({0: 1, 1: 1}, {}), ({0: 2}, {"TP2_BENCH_GPU_LIMIT": "ballast"})])
def test_otherwise_the_ballast_holds_the_rest(control, monkeypatch, per_gpu, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError, match="gpu_ballast on GPU 0"):  # no GPU here: the ballast is what was tried
        confine_gpus(22, per_gpu)
    assert not control.exists()  # MPS never started
