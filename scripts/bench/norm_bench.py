#!/usr/bin/env python3
"""GPU microbenchmark: H3's norm + modulation (+ gated residual) on one rank's rows, ComfyUI's ops vs the fused
kernels (kernels/norm_modulate.py), 3 segments as in a T2V sequence. CUDA-event medians in ms.

    python scripts/bench/norm_bench.py [--rows 7440]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import timed  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from kernels import norm_modulate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=7440)
    ap.add_argument("--dim", type=int, default=5376)
    a = ap.parse_args()
    x = torch.randn((a.rows, a.dim), device="cuda").to(torch.bfloat16)
    y = torch.randn_like(x)
    segs = [(0, 128, 0), (128, 128 + 250, 1), (128 + 250, a.rows, 2)]
    vec = torch.randn((3, a.dim), device="cuda").to(torch.bfloat16) * 0.1
    w = torch.ones(a.dim, device="cuda", dtype=torch.bfloat16)
    norm = torch.nn.RMSNorm(a.dim, eps=1e-6, device="cuda", dtype=torch.bfloat16)

    def comfy(gated):
        if gated:
            for s, e, r in segs:
                x[s:e].addcmul_(y[s:e], vec[r])
        h = norm(x)
        for s, e, r in segs:
            h[s:e].mul_(1.0 + vec[r]).add_(vec[r])
        return h

    def fused(gated):
        h = torch.empty_like(x)
        for s, e, r in segs:
            if gated:
                norm_modulate.gate_norm_modulate(x[s:e], y[s:e], vec[r], w, 1e-6, 1.0 + vec[r], vec[r], h[s:e])
            else:
                norm_modulate.norm_modulate(x[s:e], w, 1e-6, 1.0 + vec[r], vec[r], h[s:e])
        return h

    mb = a.rows * a.dim * 2 / 1e6
    for gated in (False, True):
        tc, tf = timed(lambda: comfy(gated), 50, 5), timed(lambda: fused(gated), 50, 5)
        passes = 4 if gated else 2
        print(f"rows {a.rows} x {a.dim} bf16, gated={gated}: ComfyUI ops {tc:.3f} ms, fused {tf:.3f} ms "
              f"({passes * mb / tf / 1e3:.2f} TB/s effective for {passes} passes)")  # fmt: skip


if __name__ == "__main__":
    main()
