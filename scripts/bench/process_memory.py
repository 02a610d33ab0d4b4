"""GPU and host memory of benchmark processes (nvidia-smi per process, /proc/PID/status), and small cards made of big GPUs.

sampler = ProcessSampler(); sampler.pids.add(pid)   every 0.5 s: GPU MiB per process, host RSS of the pids added
sampler.peak(pid, "gpu_mib", t0, t1)                 the peak between two times (None: never seen)
held, env, how = confine_gpus(gib, servers_per_gpu(tp, one_gpu))
                                                     each process its own card of `gib`: start the servers with `env`
                                                     (CUDA MPS's per-client limit where processes share a GPU and MPS
                                                     runs here; else gpu_ballast.py holds the rest)
held.append(hold_host(63))                           63 GiB of the host held (a 128 GiB machine made a 64 GB one)
stop_all(held)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
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


class MPS:
    """CUDA MPS's control daemon, in folders of its own. A client started with `client_env(gib)` is confined to `gib` of
    device memory (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT): its allocations fail beyond it, as on a card of that size, and no
    other client can take its room. Two ComfyUI processes sharing one GPU then meet two cards' limits, not one pool."""

    CONTROL = "nvidia-cuda-mps-control"

    def __init__(self, folder: str):
        self.dirs = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(folder, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(folder, "log")}

    @classmethod
    def available(cls) -> bool:
        """Its daemon is installed, and TP2_BENCH_GPU_LIMIT does not say `ballast` (set where probe_mps found no limit)."""
        return shutil.which(cls.CONTROL) is not None and os.environ.get("TP2_BENCH_GPU_LIMIT", "mps") != "ballast"

    def start(self) -> MPS:
        for d in self.dirs.values():
            os.makedirs(d, exist_ok=True)
        subprocess.run([self.CONTROL, "-d"], env=dict(os.environ, **self.dirs), check=True, timeout=30)
        return self

    def client_env(self, gib: float, device: int = 0) -> dict[str, str]:
        limit = f"{int(gib)}G" if gib == int(gib) else f"{int(gib * 1024)}M"
        return {**self.dirs, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{device}={limit}"}

    def terminate(self) -> None:  # as a Popen, for stop_all: the daemon quits its server once its clients have ended
        subprocess.run([self.CONTROL], input="quit\n", text=True, env=dict(os.environ, **self.dirs), timeout=30)

    def wait(self, timeout: float | None = None) -> None:
        pass


def confine_gpus(gib: float, processes_per_gpu: dict[int, int]) -> tuple[list, dict[str, str], str]:
    """Each benchmark process to `gib` of its GPU, as on a card of that size: (what to stop_all afterwards, the servers'
    environment, the method in words). Where processes share a GPU (the one-GPU mode) CUDA MPS confines each one, when
    its daemon is installed; otherwise gpu_ballast.py holds the rest, and processes sharing a GPU share what it leaves."""
    if any(n > 1 for n in processes_per_gpu.values()) and len(processes_per_gpu) == 1 and MPS.available():
        mps = MPS(tempfile.mkdtemp(prefix="tp2-mps-")).start()  # a short path: its sockets' names have a length limit
        return [mps], mps.client_env(gib, next(iter(processes_per_gpu))), f"CUDA MPS: {gib:g} GiB per process"
    shared = max(processes_per_gpu.values()) > 1
    how = f"gpu_ballast: {gib:g} GiB per process" + (", shared by the processes of a GPU" if shared else "")
    return hold_all_but(gib, processes_per_gpu), {}, how


PROBE = """import subprocess, torch
free, total = torch.cuda.mem_get_info()
print(f"client sees {free / 2**30:.2f} GiB free of {total / 2**30:.2f}; free_gib={free / 2**30:.3f}", flush=True)
held = torch.empty(int((GIB - 2) * 2**30), dtype=torch.uint8, device="cuda")
print(f"holding {held.numel() / 2**30:.1f} GiB; free now {torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB", flush=True)
print(subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"], capture_output=True, text=True).stdout)
try:
    more = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    print("LIMIT NOT ENFORCED: 4 GiB more allocated", flush=True)
except torch.OutOfMemoryError:
    print("limit enforced: 4 GiB more refused", flush=True)
"""


def probe_mps(gib: float) -> bool:
    """Whether CUDA MPS confines a client to `gib` here: a client's free-memory query and allocations, printed."""
    if not MPS.available():
        print(f"probe_mps: no {MPS.CONTROL} here", flush=True)
        return False
    mps = MPS(tempfile.mkdtemp(prefix="tp2-mps-")).start()
    try:
        run = subprocess.run([sys.executable, "-c", PROBE.replace("GIB", repr(gib))], env=dict(os.environ, **mps.client_env(gib)),
                             capture_output=True, text=True, timeout=90)  # fmt: skip
    finally:
        mps.terminate()
    print(run.stdout + run.stderr[-2000:], flush=True)
    seen = re.search(r"free_gib=([0-9.]+)", run.stdout)  # CUDA's free-memory query must see the limit, as dynamic VRAM does
    return run.returncode == 0 and "limit enforced" in run.stdout and seen is not None and float(seen[1]) <= gib


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


if __name__ == "__main__":  # python scripts/bench/process_memory.py --probe-mps 22: exit 0 where MPS confines a client
    sys.exit(0 if len(sys.argv) == 3 and sys.argv[1] == "--probe-mps" and probe_mps(float(sys.argv[2])) else 1)
