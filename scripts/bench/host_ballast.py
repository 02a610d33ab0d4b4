#!/usr/bin/env python3
"""Make a big host a small one: hold HOLD_GIB of its memory, until killed.

    python scripts/bench/host_ballast.py --hold-gib 63 &   # prints "held N GiB, available A GiB" once it holds them

The memory is anonymous and written page by page, so (with no swap) the kernel can neither drop nor swap it: processes
started afterwards meet a real limit (ComfyUI's pin budget reads psutil's available memory; the page cache competes
for what is left; the OOM killer acts at the same point). An absolute amount, not "all but": a lent machine's memory
grows as it is used (MemAvailable starts low). 63 GiB on a 128 GiB machine leaves about what a 64 GB machine has.
"""

from __future__ import annotations

import argparse
import mmap
import signal
import sys

GIB = 1 << 30
CHUNK = 64 << 20


def available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hold-gib", type=float, required=True)
    hold = int(ap.parse_args(argv).hold_gib * GIB)
    chunks, ones = [], b"\x01" * CHUNK
    for _ in range(hold // CHUNK):
        m = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.write(ones)  # every page written: resident, not the shared zero page
        chunks.append(m)
    print(f"held {len(chunks) * CHUNK / GIB:.1f} GiB, available {available() / GIB:.2f} GiB", flush=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    return 0


if __name__ == "__main__":
    sys.exit(main())
