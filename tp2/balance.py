"""--split auto's decision: shares in proportion to each rank's measured speed, no rank given more of the weights than its free memory holds
(scripts/lib/balance.py measures each GPU before any rank starts; this decides and says why). Imports nothing from `comfy`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .capacity import BLOCKS, WEIGHTS_GIB
from .split import Shares, even, named, workable

RANK_OVERHEAD_GIB = 2.0  # per rank: CUDA context, activations, the allocator's slack; not for weights
MIN_USABLE_GIB = 0.25  # a rank with less usable memory still gets a (tiny) cap, never zero or negative
AUTO_SHARE_TOTAL = 100  # auto shares sum to at most this
AUTO_TOLERANCE = 0.005  # how far a rank's share may stray from its fraction where a smaller total can be found


@dataclass(frozen=True)
class BlockShape:
    """The block scripts/lib/balance.py times: full width, `tokens` rows (int8 ConvRot on a GPU, float32 on the CPU)."""

    hidden: int
    heads: int
    head_dim: int
    ffn: int
    tokens: int
    int8: bool


H3_BLOCK = BlockShape(hidden=5376, heads=56, head_dim=128, ffn=14336, tokens=4096, int8=True)
CPU_BLOCK = BlockShape(hidden=5376 // 16, heads=14, head_dim=32, ffn=14336 // 16, tokens=256, int8=False)


def memory_caps(free_gib: list[float | None]) -> list[float]:
    """Each rank's largest fraction: as much of the DiT's split weights (WEIGHTS_GIB, whole) as its usable memory
    (free less RANK_OVERHEAD_GIB) holds; 1.0 (no cap) for a rank with None (a CPU)."""
    return [1.0 if f is None else max(f - RANK_OVERHEAD_GIB, MIN_USABLE_GIB) / WEIGHTS_GIB for f in free_gib]


def auto_fractions(block_seconds: list[float], free_gib: list[float | None]) -> list[float]:
    """Fractions in proportion to speed (1/seconds), water-filled under memory_caps: a rank over its cap is pinned
    at it and what is left is dealt again by speed among the others, until none is over."""
    speed, caps = [1.0 / s for s in block_seconds], memory_caps(free_gib)
    pinned: dict[int, float] = {}
    while True:
        free = [r for r in range(len(speed)) if r not in pinned]
        left, fast = 1.0 - sum(pinned.values()), sum(speed[r] for r in free)
        dealt = {r: left * speed[r] / fast for r in free}
        over = {r: caps[r] for r in free if dealt[r] > caps[r]}
        if not over or len(over) == len(free):
            return [pinned[r] if r in pinned else dealt[r] for r in range(len(speed))]
        pinned.update(over)


def auto_shares(block_seconds: list[float], free_gib: list[float | None]) -> Shares:
    """Whole shares for auto_fractions, each >= 1: the smallest total (at most AUTO_SHARE_TOTAL) whose fractions are
    all within AUTO_TOLERANCE of them, reduced: 0.75/0.25 -> 3:1, thirds -> 1:1:1, 0.607/0.393 -> 17:11."""
    fractions = auto_fractions(block_seconds, free_gib)
    weights = tuple(round(f * 1_000_000) for f in fractions)
    for total in range(len(fractions), AUTO_SHARE_TOTAL + 1):
        shares = workable(total, weights)
        if max(abs(s / sum(shares) - f) for s, f in zip(shares, fractions)) <= AUTO_TOLERANCE:
            return shares
    return shares


def auto_split(devices: list[str], samples: list[list[float]], free_gib: list[float | None]) -> tuple[Shares, str | None]:
    """--split auto's shares from each rank's block timings (several each), with why it kept the even split where the ranks' difference is
    within the measurement's own noise: one GPU timed for every rank, or every rank's timings overlapping (the slowest rank's fastest no
    slower than the fastest rank's slowest). On the CPU (a test run) the ranks share the cores, so only the overlap decides."""
    if len(set(devices)) == 1 and devices[0] != "cpu":
        return even(len(samples)), f"every rank is {devices[0]}, one device"
    if max(min(s) for s in samples) <= min(max(s) for s in samples):
        return even(len(samples)), "the ranks' block timings overlap: their difference is within the measurement's noise"
    return auto_shares([statistics.median(s) for s in samples], free_gib), None


def step_seconds(block_seconds: list[float], shares: Shares) -> list[float]:
    """Each rank's predicted DiT time per step at `shares`: a full-width block's time x its fraction x BLOCKS."""
    return [s * share / sum(shares) * BLOCKS for s, share in zip(block_seconds, shares)]


def describe_auto(devices: list[str], block_seconds: list[float], free_gib: list[float | None], shares: Shares) -> str:
    """The measurements and the decision, a line per rank, then the slowest rank at `shares` against even."""
    inverse = [1 / s for s in block_seconds]
    speed = [i / sum(inverse) for i in inverse]
    caps, step = memory_caps(free_gib), step_seconds(block_seconds, shares)
    lines = []
    for r, device in enumerate(devices):
        free = "n/a" if free_gib[r] is None else f"{free_gib[r]:.1f} GiB"
        cap = "none" if free_gib[r] is None else f"{caps[r]:.3f}"
        lines.append(
            f"rank {r}: {device}: free {free}, block {block_seconds[r] * 1e3:.2f} ms, speed share {speed[r]:.3f}, "
            f"memory cap {cap}, share {shares[r]}/{sum(shares)} ({shares[r] / sum(shares):.3f}), "
            f"DiT {step[r] * 1e3:.1f} ms/step"
        )
    even_step = step_seconds(block_seconds, even(len(shares)))
    slow, even_slow = step.index(max(step)), even_step.index(max(even_step))
    lines.append(
        f"split {named(shares)}: slowest rank {slow} at {step[slow] * 1e3:.1f} ms/step of DiT blocks "
        f"(even split: rank {even_slow} at {even_step[even_slow] * 1e3:.1f} ms/step)"
    )
    return "\n".join(lines)
