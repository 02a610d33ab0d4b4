"""GPU and host memory of benchmark processes (nvidia-smi per process, /proc/PID/status), and small cards and hosts made of big ones.

sampler = ProcessSampler(); sampler.pids.add(pid)   every 0.5 s: GPU MiB per process, host RSS of the pids added
sampler.peak(pid, "gpu_mib", t0, t1)                 the peak between two times (None: never seen)
held, env, how = confine_gpus(gib)                   each process its own card of `gib` (CUDA MPS's per-client limit):
                                                     start the servers with `env`
held.append(hold_host(63))                           63 GiB of the host held (a 128 GiB machine made a 64 GB one)
stop_all(held)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

QUERIES = {"gpu_mib": "--query-compute-apps=pid,used_memory", "card_mib": "--query-gpu=index,memory.used"}


class ProcessSampler:
    """Every 0.5 s, per process: GPU MiB (nvidia-smi --query-compute-apps) and host RSS / anonymous / file-backed KiB;
    cards=True: per GPU too, its MiB used as "card_mib" under its index for a pid."""

    def __init__(self, cards: bool = False):
        self.pids: set[int] = set()
        self.samples: list[tuple[float, int, str, int]] = []  # (time, pid, what, value)
        self._stop = threading.Event()
        self._queries = {k: q for k, q in QUERIES.items() if cards or k == "gpu_mib"}
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self._stop.wait(0.5):
            t = time.time()
            for what, query in list(self._queries.items()):
                try:
                    out = subprocess.run(
                        ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10
                    ).stdout
                except (FileNotFoundError, subprocess.TimeoutExpired):  # a CPU dry run
                    self._queries, out = {}, ""
                for line in out.splitlines():
                    try:
                        key, mib = (int(x) for x in line.split(","))
                    except ValueError:
                        continue
                    self.samples.append((t, key, what, mib))
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


class MPS:
    """CUDA MPS's control daemon, in folders of its own. A client started with `client_env(gib)` is confined to `gib` of
    device memory (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT): its allocations fail beyond it, as on a card of that size, and no
    other client can take its room. Two ComfyUI processes sharing one GPU then meet two cards' limits, not one pool."""

    CONTROL = "nvidia-cuda-mps-control"

    def __init__(self, folder: str):
        self.dirs = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(folder, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(folder, "log")}

    def start(self) -> MPS:
        for d in self.dirs.values():
            os.makedirs(d, exist_ok=True)
        subprocess.run([self.CONTROL, "-d"], env=dict(os.environ, **self.dirs), check=True, timeout=30)
        return self

    def client_env(self, gib: float) -> dict[str, str]:  # on device 0: each server sees one GPU (CUDA_VISIBLE_DEVICES)
        limit = f"{int(gib)}G" if gib == int(gib) else f"{int(gib * 1024)}M"
        return {**self.dirs, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={limit}"}

    def terminate(self) -> None:  # as a Popen, for stop_all: the daemon quits its server once its clients have ended
        subprocess.run([self.CONTROL], input="quit\n", text=True, env=dict(os.environ, **self.dirs), timeout=30)

    def wait(self, timeout: float | None = None) -> None:
        pass


def need_mps() -> None:
    """A GPU cap's check, before anything starts: CUDA MPS's control daemon is installed here."""
    if shutil.which(MPS.CONTROL) is None:
        raise SystemExit(f"a GPU cap needs CUDA MPS ({MPS.CONTROL} is not installed here): run without the cap")


def confine_gpus(gib: float) -> tuple[list, dict[str, str], str]:
    """Each benchmark process to `gib` of its GPU, as on a card of that size, by CUDA MPS: (what to stop_all afterwards,
    the servers' environment, the method in words)."""
    need_mps()
    mps = MPS(tempfile.mkdtemp(prefix="tp2-mps-")).start()  # a short path: its sockets' names have a length limit
    return [mps], mps.client_env(gib), f"CUDA MPS: {gib:g} GiB per process"


def hold_host(gib: float) -> subprocess.Popen:
    """A process holding `gib` of the host's memory (this file as a script), started and holding."""
    p = subprocess.Popen([sys.executable, __file__, "--hold-host-gib", str(gib)], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if not line.startswith("held"):
        stop_all([p])
        raise RuntimeError(f"hold_host: {line or 'exited'}")
    print(f"host: {line}", flush=True)
    return p


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(30)


if __name__ == "__main__":  # hold_host's child, until killed: python scripts/bench/process_memory.py --hold-host-gib G
    # Anonymous memory, every page written: with no swap the kernel can neither drop nor swap it, so processes started
    # afterwards meet a real limit (ComfyUI's pin budget reads the available memory; the page cache competes for the
    # rest). An absolute amount, not "all but": a lent machine's memory grows as it is used (MemAvailable starts low).
    held = b"\x01" * int(float(sys.argv[2]) * 2**30)
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) / 2**20 for line in f if line.startswith("MemAvailable:"))
    print(f"held {len(held) / 2**30:.1f} GiB, available {available:.2f} GiB", flush=True)
    signal.pause()
