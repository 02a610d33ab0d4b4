"""`scripts/start-tp2.sh check`: will H3 run on this machine, and how fast? Seconds, no ComfyUI started, no model files.

    check.py --tp-size N [--gpus 0,1 | --cpu] [--split 3:2|auto]

Per GPU: its name, compute capability, the compute dtype the pack will use, free memory, and one H3-shaped block's
time at its share (scripts/lib/balance.py's block; on the CPU its narrow stand-in); the link between the ranks (one
process per rank, the all-reduce every rank times as its group forms: tp2/link.py); the longest video per resolution,
weights resident and streamed (tp2/capacity.py at each GPU's free memory; 22 GiB per rank on the CPU); the predicted
speed-up against the fastest card alone (tp2/link.py's model of a pair); the host memory the ranks need beside what
this machine has available (host_lines). Exit 1 with a one-line reason when it cannot measure. Run with the pack's folder on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import balance

from tp2 import capacity, settings
from tp2.balance import auto_split
from tp2.compute_dtype import choose_compute_dtype
from tp2.errors import PlanError
from tp2.link import NCCL_FOR_KIND, link_kind
from tp2.split import even, parse_split

CPU_STAND_IN_GIB = 22.0  # the capacity table without a GPU: a 2080 Ti 22 GB per rank
# A rank's private host memory (anonymous and shared: not the file cache), the bundled T2V+audio workflow at tp_size 2 with
# the rank cache, measured on one H100 on 2026-12-06 (docs/PERFORMANCE.md, host memory): as the launcher starts ranks
# (ComfyUI's --disable-pinned-memory), and what --pin-weights adds (page-locked weight copies; they scale with the share).
RANK_GIB = {(832, 480, 124): 4.3, (1920, 1088, 124): 10.1}
PINS_GIB = 25.7 - 4.3  # 832x480x124 with the copies, less without
HEADROOM_GIB = 2.0  # per process: what ComfyUI keeps free before it gives up pinned copies (model_management.py)


def gpu_lines(gpus: list[str], block_s: list[float], free: list[float | None], shares) -> tuple[list[str], str]:
    """A line per rank's device (name, capability, compute dtype, free memory, the block at its share), and the dtype
    the ranks compute in together: fp32 where any of them would (what the launcher sets)."""
    import torch

    lines, dtypes = [], set()
    for r, gpu in enumerate(gpus):
        at_share = f"one block at its share {shares[r]}/{sum(shares)}: {block_s[r] * shares[r] / sum(shares) * 1e3:.2f} ms"
        if free[r] is None:
            dtypes.add(compute_dtype(None))
            lines.append(f"rank {r}: CPU (the stand-in block), compute dtype {compute_dtype(None)}, {at_share}")
            continue
        p = torch.cuda.get_device_properties(list(dict.fromkeys(gpus)).index(gpu))
        dtypes.add(compute_dtype((p.major, p.minor)))
        lines.append(f"rank {r}: GPU {gpu} {p.name}, compute capability {p.major}.{p.minor}, compute dtype "
                     f"{compute_dtype((p.major, p.minor))}, {free[r]:.1f} of {p.total_memory / 2**30:.1f} GiB free, {at_share}")  # fmt: skip
    return lines, "fp32" if "fp32" in dtypes else "bf16"


def compute_dtype(capability: tuple[int, int] | None) -> str:
    """The dtype the DiT will compute in on a device of this capability (None: the CPU), under TP2_COMPUTE_DTYPE."""
    return choose_compute_dtype(capability, settings.value("TP2_COMPUTE_DTYPE"))[0]


def capacity_lines(free_gib: list[float], shares, cpu: bool, dtype: str) -> list[str]:
    """The longest video per resolution on every rank at `shares`, weights resident and streamed, in `dtype` compute
    with the settings the launcher exported (--fast: sequence parallelism)."""
    where = f"{CPU_STAND_IN_GIB:g} GiB per rank (no GPU here)" if cpu else "each GPU's free memory"
    fast = bool(settings.value("TP2_SEQUENCE_PARALLEL"))
    lines = [f"longest video on {where}, split {':'.join(map(str, shares))}, {dtype} compute{', --fast' if fast else ''}: "
             "frames (seconds at 24 fps)"]  # fmt: skip
    for w, h in capacity.RESOLUTIONS:
        cells = []
        for label, streamed in (("resident (--highvram)", False), ("streamed (dynamic VRAM)", True)):
            frames, _ = capacity.longest_on_every_rank(w, h, free_gib, shares, streamed, dtype=dtype, fast=fast)
            cells.append(f"{label} {frames} ({frames / 24:.1f} s)" if frames else f"{label} none")
        lines.append(f"  {w}x{h}: " + ", ".join(cells))
    return lines


def meminfo_gib() -> tuple[float, float]:
    """(available, total) host memory in GiB, as the kernel tells it (/proc/meminfo)."""
    with open("/proc/meminfo") as f:
        kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}
    return kib["MemAvailable"] / 2**20, kib["MemTotal"] / 2**20


def rank_host_gib(w: int, h: int, t: int, tp_size: int) -> tuple[float, float]:
    """(as the launcher starts it, with --pin-weights) private host GiB of one rank for the bundled workflow at w x h x t."""
    return RANK_GIB[w, h, t], RANK_GIB[w, h, t] + PINS_GIB * 2 / tp_size


def host_lines(tp_size: int, available: float, total: float) -> list[str]:
    """What the ranks hold in host memory per size beside what is available here, and what that means."""
    lines = [f"host memory: {available:.1f} GiB available of {total:.1f}; the ranks hold, each its own (measured):"]
    for w, h, t in RANK_GIB:
        own, pinned = rank_host_gib(w, h, t, tp_size)
        if available < tp_size * (own + HEADROOM_GIB):
            verdict = "will not fit: the kernel's out-of-memory killer would end a rank; use fewer frames or a smaller size, or more RAM"
        elif available < tp_size * (pinned + HEADROOM_GIB):
            verdict = "fits; with --pin-weights ComfyUI would drop pinned copies for lack of RAM and read them again each prompt"
        else:
            verdict = "fits, with --pin-weights too"
        lines.append(f"  {w}x{h}x{t}: {tp_size} x {own:.1f} = {tp_size * own:.1f} GiB ({tp_size} x {pinned:.1f} with --pin-weights): {verdict}")
    return lines


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="start-tp2.sh check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--gpus", default="")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--split", default="")
    a = ap.parse_args(argv)
    gpus = a.gpus.split(",") if a.gpus else [str(r) for r in range(a.tp_size)]
    if len(gpus) != a.tp_size or not all(g.isdigit() for g in gpus):
        ap.error(f"--gpus {a.gpus} must list {a.tp_size} GPU indices (one per rank)")
    try:
        chosen = None if a.split in ("", "auto") else parse_split(a.split, a.tp_size)
    except PlanError as e:
        ap.error(str(e))
    try:
        nccl = []
        if not a.cpu:
            for name, value in NCCL_FOR_KIND.get(link_kind("nccl", gpus), {}).items():  # timed as the launcher sets it
                nccl.append(f"{name}={os.environ.setdefault(name, value)}" + (" (yours)" if os.environ[name] != value else ""))
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(gpus))
        names, samples, free = balance.measure(a.cpu, gpus)
        link = balance.measure_link_between(a.cpu, gpus)
    except Exception as e:  # one line: what could not be measured, and why
        hint = "" if a.cpu else " (without NVIDIA GPUs: --cpu)"
        print(
            f"check: could not measure {'the CPU' if a.cpu else 'GPUs ' + ','.join(gpus)}: {type(e).__name__}: {e}{hint}", file=sys.stderr
        )
        return 1
    block_s, auto = [statistics.median(s) for s in samples], auto_split(names, samples, free)[0]
    shares = chosen or (auto if a.split == "auto" else even(a.tp_size))
    free_gib = [CPU_STAND_IN_GIB if f is None else f for f in free]
    lines, dtype = gpu_lines(gpus, block_s, free, shares)
    nccl_line = f"NCCL: {' '.join(nccl)} (the launcher's, published for this link; not measured by the pack)" if nccl else "NCCL: its defaults"
    print("\n".join([*lines, f"link: {link.text()}", nccl_line, *capacity_lines(free_gib, shares, a.cpu, dtype), *balance.speed_lines(block_s, auto, link, chosen, a.cpu),
                     *host_lines(a.tp_size, *meminfo_gib()),
                     f"for the ranks' log: TP2_BLOCK_MS={','.join(f'{s * 1e3:.3f}' for s in block_s)}"]))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
