"""A fresh host buffer's pages mapped ahead of its writer, by a background thread, without changing a byte.

ComfyUI allocates the H3 video decode's float32 output on the host afresh at every decode (594 MB at 832x480x124,
1.5 GB at 1344x768x124, 9 GB at 1920x1088x362). Linux maps a fresh allocation's pages at their first write, and
that write is the decode's own copy of each finished chunk, on the critical path of every rank (on this project's
CPU machine: 0.17 s to first-write 594 MB against 0.04 s to write it again). `populated_ahead` has the kernel map
the pages now, from a daemon thread, slab by slab in the order the writer fills them (along `dim`), while the
decode computes. It uses madvise(MADV_POPULATE_WRITE) (Linux 5.14+), which maps pages writable as a write would
but writes nothing: a page the writer reached first stays as it is, so the thread and the writer need no ordering
and the buffer's contents are the same with it or without. Where the kernel refuses it (older Linux, another OS)
nothing is done, and `populated_ahead` says so once in the log.

    with populated_ahead(buf, dim=2) as ahead:   # the thread runs during the block and is joined at its end
        ...                                      # str(ahead): what it did (bytes, seconds) or why not

Imports torch only; never `comfy`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14)
MIN_BYTES = 64 << 20  # smaller buffers fault in a few milliseconds: not worth a thread
SLAB_BYTES = 32 << 20  # one madvise call maps about this much

_unsupported: str | None = None  # why the kernel refused, once it has


@dataclass
class Ahead:
    """What one populated_ahead did: the bytes it had the kernel map, the seconds that took, or why it did nothing."""

    bytes: int = 0
    seconds: float = 0.0
    done: bool = False
    skipped: str | None = None  # why nothing was done

    def __str__(self) -> str:
        if self.skipped:
            return f"not paged in ahead ({self.skipped})"
        return f"{self.bytes / 1e6:.0f} MB paged in ahead in {self.seconds:.2f} s{'' if self.done else ' (stopped early)'}"


def slabs(t: torch.Tensor, dim: int, slab_bytes: int = SLAB_BYTES) -> list[tuple[int, int]]:
    """(address, length) byte ranges covering contiguous `t`, ordered by position along `dim`: for each slab of
    positions along `dim`, every outer index's range (the order a writer filling `dim` front to back touches them)."""
    if not t.is_contiguous():
        raise ValueError("slabs: the tensor must be contiguous")
    dim = dim % t.dim()
    outer = math.prod(t.shape[:dim])
    row = math.prod(t.shape[dim + 1 :]) * t.element_size()  # bytes of one position along dim
    per_slab = max(1, slab_bytes // max(1, row * outer))
    base, length = t.data_ptr(), t.shape[dim]
    out = []
    for s0 in range(0, length, per_slab):
        s1 = min(length, s0 + per_slab)
        out += [(base + (o * length + s0) * row, (s1 - s0) * row) for o in range(outer)]
    return out


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def _populate(ranges: list[tuple[int, int]], stop: threading.Event, ahead: Ahead) -> None:
    global _unsupported
    page = os.sysconf("SC_PAGE_SIZE")
    madvise = _madvise()
    t0 = time.monotonic()
    for addr, length in ranges:
        if stop.is_set():
            break
        start = addr & ~(page - 1)  # the page holding addr belongs to the same allocation
        if madvise(start, length + addr - start, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            _unsupported = f"madvise(MADV_POPULATE_WRITE) failed: {os.strerror(err)} (Linux 5.14 or newer has it)"
            ahead.skipped = _unsupported
            log.info("host buffer not paged in ahead: %s; the decode's writes map the pages as they go", _unsupported)
            return
        ahead.bytes += length
    ahead.seconds, ahead.done = time.monotonic() - t0, not stop.is_set()


@contextlib.contextmanager
def populated_ahead(t: torch.Tensor | None, dim: int = 0):
    """Map `t`'s pages from a background thread while the block runs (host, contiguous, >= 64 MiB; otherwise, or
    where the kernel cannot, nothing is done); joined when the block ends, early if it raises. Yields an Ahead."""
    ahead = Ahead()
    if t is None or t.device.type != "cpu" or not t.is_contiguous() or t.numel() * t.element_size() < MIN_BYTES:
        ahead.skipped = "not a contiguous host buffer of 64 MiB or more"
    elif not sys.platform.startswith("linux"):
        ahead.skipped = f"not on Linux ({sys.platform})"
    elif _unsupported is not None:
        ahead.skipped = _unsupported
    if ahead.skipped is not None:
        yield ahead
        return
    stop = threading.Event()
    thread = threading.Thread(target=_populate, args=(slabs(t, dim), stop, ahead), name="tp2-prefault", daemon=True)
    thread.start()
    try:
        yield ahead
    except BaseException:
        stop.set()
        raise
    finally:
        thread.join()
