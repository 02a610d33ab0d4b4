"""Faults on demand, for the failure tests only: inert unless the TP2_TEST_* setting each function names is set.

With TP2_TEST_FAULT_FILE=PATH, a file at PATH holding `RANK:CALL:KIND` makes rank RANK raise at model evaluation
CALL of a prompt (1-based; 0 = at the sampler, before the ranks meet; `tile` = at this rank's first tile of a split
decode) and then deletes the file, so the fault fires once. KIND: `error` (a RuntimeError), `oom` (a
torch.OutOfMemoryError worded like CUDA's), `sleep` (5 s late), `hang` (alive but making no progress until the run
is stopped, at most 120 s: as a rank stuck in a kernel).
"""

from __future__ import annotations

import os
import time

import torch

from ..tp2 import settings

NUDGED_VALUES = 300
_PATH = settings.value("TP2_TEST_FAULT_FILE")


def maybe_break_int8(gemm, rank: int):
    """`gemm` itself, or on a rank listed in TP2_TEST_BREAK_INT8_RANKS a wrong one (rows rolled by 16)."""
    if str(rank) not in settings.value("TP2_TEST_BREAK_INT8_RANKS"):
        return gemm

    def broken(*args, **kwargs):
        return gemm(*args, **kwargs).roll(16, 0)

    broken.kernel_name = f"{gemm.kernel_name} (broken on purpose by TP2_TEST_BREAK_INT8_RANKS)"
    return broken


def nudge_output(rank: int, t: torch.Tensor) -> None:
    """On a rank listed in TP2_TEST_NUDGE_RANKS: NUDGED_VALUES evenly spaced values of float tensor `t`, 1/255 up."""
    if str(rank) not in settings.value("TP2_TEST_NUDGE_RANKS") or t.dtype not in (torch.float32, torch.float64):
        return
    dense = t if t.is_contiguous() else t.movedim(-1, 1)  # VAE.decode returns a movedim of its contiguous output
    if not dense.is_contiguous():
        return
    flat = dense.view(-1)
    at = torch.linspace(0, flat.numel() - 1, NUDGED_VALUES).long()
    flat[at] += 1.0 / 255


def nudge_file(rank: int, path: str) -> None:
    """On a rank listed in TP2_TEST_NUDGE_RANKS: one byte more at the end of the output file at `path`."""
    if str(rank) in settings.value("TP2_TEST_NUDGE_RANKS"):
        with open(path, "ab") as f:
            f.write(b"\0")


def inject_fault(rank: int, call: int | str, stop_reason=lambda: None) -> None:
    if _PATH is None or not os.path.exists(_PATH):
        return
    try:
        with open(_PATH) as f:
            want_rank, want_call, kind = f.read().strip().split(":")
    except (OSError, ValueError):
        return
    if int(want_rank) != rank or want_call != str(call):
        return
    os.remove(_PATH)
    if kind == "sleep":
        time.sleep(5.0)
    elif kind == "hang":
        deadline = time.monotonic() + 120.0
        while time.monotonic() < deadline and not stop_reason():
            time.sleep(0.1)
    elif kind == "oom":
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 21.48 GiB (injected by TP2_TEST_FAULT_FILE)"
        )
    else:
        raise RuntimeError(f"injected fault at model call {call} (TP2_TEST_FAULT_FILE)")
