"""GPU and host memory of benchmark processes (nvidia-smi per process, /proc/PID/status), and small cards made of big GPUs.

sampler = ProcessSampler(); sampler.pids.add(pid)   every 0.5 s: GPU MiB per process, host RSS of the pids added
sampler.peak(pid, "gpu_mib", t0, t1)                 the peak between two times (None: never seen)
held = hold_all_but(gib, servers_per_gpu(tp, one_gpu))   each GPU made a card of `gib` per process on it
held.append(hold_host(63))                           63 GiB of the host held (a 128 GiB machine made a 64 GB one)
stop_all(held)
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time


class ProcessSampler:
    """Every 0.5 s, per process: GPU MiB (nvidia-smi --query-compute-apps) and host RSS / anonymous / file-backed KiB."""

    def __init__(self):
        self.pids: set[int] = set()
        self.samples: list[tuple[float, int, str, int]] = []  # (time, pid, what, value)
        self._stop = threading.Event()
        self._gpu = True
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        cmd = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        while not self._stop.wait(0.5):
            t = time.time()
            if self._gpu:
                try:
                    out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
                except (FileNotFoundError, subprocess.TimeoutExpired):  # a CPU dry run
                    self._gpu, out = False, ""
                for line in out.splitlines():
                    try:
                        pid, mib = (int(x) for x in line.split(","))
                    except ValueError:
                        continue
                    self.samples.append((t, pid, "gpu_mib", mib))
            for pid in list(self.pids):
                try:
                    with open(f"/proc/{pid}/status") as f:
                        status = dict(line.split(":", 1) for line in f if ":" in line)
                except OSError:
                    continue
                for key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    if key in status:
                        self.samples.append((t, pid, key, int(status[key].split()[0])))

    def peak(self, pid: int, what: str, t0: float, t1: float) -> int | None:
        return max((v for t, p, w, v in self.samples if p == pid and w == what and t0 <= t <= t1), default=None)

    def stop(self):
        self._stop.set()


def servers_per_gpu(tp_size: int, one_gpu: bool) -> dict[int, int]:
    """GPU index -> how many of a configuration's servers run on it (one per GPU, or all on GPU 0)."""
    return {0: tp_size} if one_gpu else {r: 1 for r in range(tp_size)}


def hold_all_but(gib_per_process: float, processes_per_gpu: dict[int, int]) -> list[subprocess.Popen]:
    """On every GPU given, a scripts/bench/gpu_ballast.py process holding all of its free memory but
    `gib_per_process` x the processes that will share it, started and holding before this returns."""
    held = []
    for gpu, n in processes_per_gpu.items():
        ballast = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_ballast.py")
        p = subprocess.Popen([sys.executable, ballast, "--leave-gib", str(gib_per_process * n)],
                             env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu)), stdout=subprocess.PIPE, text=True)  # fmt: skip
        line = p.stdout.readline().strip()
        if not line.startswith("held"):
            stop_all(held + [p])
            raise RuntimeError(f"gpu_ballast on GPU {gpu}: {line or 'exited'}")
        print(f"GPU {gpu}: {line}", flush=True)
        held.append(p)
    return held


def hold_host(gib: float) -> subprocess.Popen:
    """A scripts/bench/host_ballast.py process holding `gib` of the host's memory, started and holding."""
    ballast = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_ballast.py")
    p = subprocess.Popen([sys.executable, ballast, "--hold-gib", str(gib)], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if not line.startswith("held"):
        stop_all([p])
        raise RuntimeError(f"host_ballast: {line or 'exited'}")
    print(f"host: {line}", flush=True)
    return p


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(30)
