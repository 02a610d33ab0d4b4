#!/usr/bin/env python3
"""GPU microbenchmark: H3's norm + modulation (+ gated residual) on one rank's rows, ComfyUI's ops vs the fused
kernels (kernels/norm_modulate.py), 3 segments as in a T2V sequence; and the attention's q/k norm + rope,
comfy-kitchen's kernel vs kernels/qk_norm_rope.py, in a qkv buffer of the whole sequence (2 x rows) with a TP2
rank's heads and one GPU's. CUDA-event medians in ms.

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
from kernels import norm_modulate, qk_norm_rope  # noqa: E402


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

    rope_bench(2 * a.rows)


def rope_bench(s: int, d: int = 128, pairs: int = 48) -> None:
    import comfy_kitchen as ck

    for heads in (28, 56):
        qkv = torch.randn((s, 3 * heads * d), device="cuda").to(torch.bfloat16)
        q, k, _ = (t.view(s, heads, d) for t in qkv.split(heads * d, dim=-1))
        angles = torch.rand((s, pairs), device="cuda")
        c, sn = torch.cos(angles), torch.sin(angles)
        table = torch.stack([c, -sn, sn, c], dim=-1).reshape(1, s, 1, pairs, 2, 2).to(torch.bfloat16)
        w = torch.ones(d, device="cuda", dtype=torch.bfloat16)
        t_ck = timed(lambda: ck.rms_rope_split_half_(q[None], k[None], table, w, w, epsilon=1e-6, rot_dim=2 * pairs), 50, 5)
        t_tr = timed(lambda: qk_norm_rope.rms_rope_split_half_(q, k, table, w, w, 1e-6), 50, 5)
        gb = 2 * 2 * s * heads * d * 2 / 1e9  # q and k, read and written
        print(f"q/k norm + rope, {s} rows x {heads} heads: comfy-kitchen {t_ck:.3f} ms ({gb / t_ck:.2f} TB/s), "
              f"Triton {t_tr:.3f} ms ({gb / t_tr:.2f} TB/s)")  # fmt: skip


if __name__ == "__main__":
    main()
