#!/usr/bin/env python3
"""Make a big GPU a small card: hold all of GPU 0's free memory but LEAVE_GIB, until killed.

    python scripts/bench/gpu_ballast.py --leave-gib 22 &    # prints "held N GiB, left L GiB" once it holds them

Processes started afterwards on that GPU meet a real limit (torch's allocator, ComfyUI's free-memory decisions and
dynamic VRAM's eviction see a 22 GiB card's free memory); processes sharing the GPU share what is left.
"""

from __future__ import annotations

import argparse
import signal
import sys

import torch

GIB = 1 << 30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leave-gib", type=float, required=True)
    a = ap.parse_args(argv)
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(0)
    hold = free - int(a.leave_gib * GIB)
    if hold <= 0:
        print(f"gpu_ballast: only {free / GIB:.1f} GiB free of {total / GIB:.1f}: nothing to hold", flush=True)
        return 1
    ballast = torch.empty(hold, dtype=torch.uint8, device="cuda:0")
    left, _ = torch.cuda.mem_get_info(0)
    print(f"held {ballast.numel() / GIB:.1f} GiB, left {left / GIB:.2f} GiB of {total / GIB:.1f}", flush=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    return 0


if __name__ == "__main__":
    sys.exit(main())
