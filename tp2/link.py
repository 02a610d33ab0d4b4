"""The link between the ranks, measured once as the group forms (one timed all-reduce), and what it means for speed:
the kind of link from `nvidia-smi topo`, and docs/PERFORMANCE.md's speed-up model of a pair (the slowest rank's block at
its share plus two all-reduces per block, against the fastest card alone; under MEMORY_NOT_SPEED, TP buys memory).
Bus bandwidth is NCCL's (nccl-tests): bytes / seconds x 2 (n - 1) / n. Imports torch only; never `comfy`.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

import torch

from . import settings
from .balance import CPU_BLOCK, H3_BLOCK
from .collectives import TPGroup, all_gather_object, all_reduce
from .errors import PlanError
from .split import parse_split
from .wire import EXACT, WIRE_BYTES

LINK_MIB = {"cuda": 64, "cpu": 8}  # the timed all-reduce: tens of MB on a GPU; on the CPU (gloo, tests) well under 1 s
MEMORY_NOT_SPEED = 1.2  # a predicted speed-up below this: the pair is for memory (longer videos), not speed
HOST = "gloo, host memory"
NO_P2P = "through host memory (PCIe without peer-to-peer)"
# NCCL's settings per link kind, exported by the launcher unless the user set them. Not measured by this pack: published,
# two PCIe 4.0 cards without peer-to-peer moved 1.9 GB/s at 20 MB, 12.5 GB/s with shared memory copied by the GPUs' engines
NCCL_FOR_KIND = {NO_P2P: {"NCCL_SHM_USE_CUDA_MEMCPY": "1"}}


@dataclass(frozen=True)
class Link:
    bus_gbps: float
    kind: str
    mib: int
    seconds: float

    def text(self) -> str:
        return f"{self.bus_gbps:.1f} GB/s bus bandwidth ({self.kind}; one {self.mib} MiB all-reduce in {self.seconds * 1e3:.1f} ms)"


def bus_factor(tp_size: int) -> float:
    return 2 * (tp_size - 1) / tp_size


def measure_link(tp: TPGroup, gpu: str = "") -> Link:
    """Time one all-reduce of LINK_MIB over `tp` after a small warm-up (NCCL connects at its first collective); every
    rank gives its GPU (`gpu`, its CUDA_VISIBLE_DEVICES) so the kind can be named. Collective: every rank calls it."""
    gpus = all_gather_object(gpu, tp)
    mib = LINK_MIB["cuda" if tp.device.type == "cuda" else "cpu"]
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=tp.device)
    all_reduce(x[:1024], tp)
    sync = torch.cuda.synchronize if tp.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    all_reduce(x, tp)
    sync()
    seconds = max(all_gather_object(time.perf_counter() - start, tp))  # one figure on every rank: the slowest rank's view
    gbps = mib * 2**20 / seconds * bus_factor(tp.tp_size) / 1e9
    return Link(gbps, link_kind(tp.backend, gpus), mib, seconds)


def _cell(table: str, a: str, b: str) -> str | None:
    """Row GPU`a`, column GPU`b` of an `nvidia-smi topo` matrix (None: not there)."""
    lines = [line.split() for line in table.splitlines() if line.strip()]
    head = lines[0] if lines else []
    row = next((cells for cells in lines[1:] if cells[0] == f"GPU{a}"), None)
    col = head.index(f"GPU{b}") + 1 if f"GPU{b}" in head else None
    return row[col] if row is not None and col is not None and col < len(row) else None


def kind_from_topo(matrix: str, p2p: str, gpus: list[str]) -> str:
    """The slowest hop among `gpus` (nvidia-smi indices), from `nvidia-smi topo -m` and `nvidia-smi topo -p2p r`."""
    pairs = [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :] if a != b]
    if not pairs:
        return "one GPU (ranks share it)"
    hops = [(_cell(matrix, a, b), _cell(p2p, a, b)) for a, b in pairs]
    if any(hop is None for hop, _ in hops):
        return f"unknown (nvidia-smi topo does not list GPUs {','.join(gpus)})"
    if all(hop.startswith("NV") for hop, _ in hops):
        return f"NVLink ({', '.join(sorted({hop for hop, _ in hops}))})"
    if all(ok == "OK" for _, ok in hops):
        return f"PCIe peer-to-peer ({', '.join(sorted({hop for hop, _ in hops}))})"
    return NO_P2P


def link_kind(backend: str, gpus: list[str]) -> str:
    """What carries the ranks' collectives: gloo goes through host memory; NCCL's path from nvidia-smi's topology."""
    if backend != "nccl":
        return HOST
    gpus = [g.split(",")[0] for g in gpus]
    try:
        run = [subprocess.run(["nvidia-smi", "topo", *a], capture_output=True, text=True, timeout=10) for a in (["-m"], ["-p2p", "r"])]
    except (OSError, subprocess.SubprocessError) as e:
        return f"NCCL, kind unknown (nvidia-smi topo: {e})"
    if any(r.returncode != 0 for r in run) or not all(g.isdigit() for g in gpus):
        return f"NCCL, kind unknown (nvidia-smi topo failed, or GPUs {','.join(gpus)} are not indices)"
    return kind_from_topo(run[0].stdout, run[1].stdout, gpus)


def predict_speedup(block_s: list[float], shares: tuple[int, ...], bus_gbps: float, tokens: int, hidden: int,
                    reduce_bytes: float) -> tuple[float, float]:  # fmt: skip
    """(speed-up, collectives' seconds per block): each rank's full-width block (`block_s`, timed at `tokens` rows of
    `hidden`) at its share, the slowest one plus two all-reduces of tokens x hidden x reduce_bytes at `bus_gbps`,
    against the fastest card alone running the whole block. A model: nothing overlapped, no cost to quantise."""
    n = len(shares)
    comm = 2 * tokens * hidden * reduce_bytes * bus_factor(n) / (bus_gbps * 1e9) if n > 1 else 0.0
    slowest = max(s * share / sum(shares) for s, share in zip(block_s, shares))
    return min(block_s) / (slowest + comm), comm


def verdict(speedup: float, shares: tuple[int, ...]) -> str:
    """The prediction in words; under MEMORY_NOT_SPEED it says plainly what TP buys here."""
    said = f"predicted {speedup:.2f}x the fastest card alone at {':'.join(map(str, shares))}"
    if speedup < MEMORY_NOT_SPEED:
        return f"{said}: TP buys memory here, not speed (longer or larger videos than one card holds)"
    return said


def prediction(link: Link, tp_size: int, device_type: str) -> str:
    """The speed-up at this run's shares from each rank's block time (TP2_BLOCK_MS, timed as `--split auto` and
    `start-tp2.sh check` time it), or why there is none."""
    block_ms = settings.value("TP2_BLOCK_MS") or []
    try:
        shares = parse_split(settings.value("TP2_SPLIT") or "", tp_size)
        block_s = [float(ms) / 1e3 for ms in block_ms]
    except (PlanError, ValueError) as e:
        return f"speed-up not predicted: {e}"
    if len(block_s) != tp_size or min(block_s) <= 0:
        return "speed-up not predicted: no block time per rank (set TP2_BLOCK_MS as `start-tp2.sh check` prints it)"
    shape = H3_BLOCK if device_type == "cuda" else CPU_BLOCK
    wire = settings.value("TP2_WIRE")
    reduce_bytes = WIRE_BYTES[settings.value("TP2_REDUCE_DTYPE") if wire == EXACT else wire]
    speedup, _ = predict_speedup(block_s, shares, link.bus_gbps, shape.tokens, shape.hidden, reduce_bytes)
    return verdict(speedup, shares)
