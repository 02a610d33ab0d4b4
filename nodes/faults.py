"""Faults on demand, for the failure tests only: inert unless TP2_TEST_FAULT_FILE is set.

With TP2_TEST_FAULT_FILE=PATH, a file at PATH holding `RANK:CALL:KIND` makes rank RANK raise at model evaluation
CALL of a prompt (1-based; 0 = at the sampler, before the ranks meet) and then deletes the file, so the fault
fires once. KIND: `error` (a RuntimeError), `oom` (a torch.OutOfMemoryError worded like CUDA's), `sleep` (5 s late).
"""

from __future__ import annotations

import os
import time

import torch

ENV_FAULT_FILE = "TP2_TEST_FAULT_FILE"
_PATH = os.environ.get(ENV_FAULT_FILE)


def inject_fault(rank: int, call: int) -> None:
    if _PATH is None or not os.path.exists(_PATH):
        return
    try:
        with open(_PATH) as f:
            want_rank, want_call, kind = f.read().strip().split(":")
    except (OSError, ValueError):
        return
    if int(want_rank) != rank or int(want_call) != call:
        return
    os.remove(_PATH)
    if kind == "sleep":
        time.sleep(5.0)
        return
    if kind == "oom":
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 21.48 GiB (injected by TP2_TEST_FAULT_FILE)"
        )
    raise RuntimeError(f"injected fault at model call {call} (TP2_TEST_FAULT_FILE)")
