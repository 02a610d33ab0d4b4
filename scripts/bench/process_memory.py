"""GPU and host memory of benchmark processes, sampled beside them: nvidia-smi per process, /proc/PID/status.

sampler = ProcessSampler(); sampler.pids.add(pid)   every 0.5 s: GPU MiB per process, host RSS of the pids added
sampler.peak(pid, "gpu_mib", t0, t1)                 the peak between two times (None: never seen)
gpu_total_gib()                                      GPU 0's memory (None without nvidia-smi)
"""

from __future__ import annotations

import subprocess
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


def gpu_total_gib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout  # fmt: skip
        return int(out.split()[0]) / 1024
    except (FileNotFoundError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None
