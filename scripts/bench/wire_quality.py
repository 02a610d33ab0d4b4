#!/usr/bin/env python3
"""What each TP2_WIRE costs in quality on H3's full-size row-parallel layers (out_proj, fc2) with random int8 ConvRot
weights: TP2's sum (each rank's half of K, partial sums in TP2_REDUCE_DTYPE, summed through the wire as every rank
sums it: tp2.wire.sum_here) against TP1's one GEMM over the whole K, and both against fp32 math on the dequantised
weights; SQNR in dB. A layer's figure, not a video's: the latents' SQNR needs the whole model (bench_comfy.py).
  PYTHONPATH=$PWD:/tmp/ck python3 scripts/bench/wire_quality.py --tokens 15100     [--cpu: a small check of the script]
"""

from __future__ import annotations

import argparse
import json

import torch


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return round(float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum().clamp_min(1e-300))), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=15100, help="15100: 832x480x124")
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    from kernels import select_int8_gemm, wire_codec
    from kernels.int8_gemm import quantize_int8_convrot
    from tp2 import wire
    from tp2.layers import Int8Weight, local_linear

    wire.use_fused(wire_codec.select)
    device = torch.device("cpu" if a.cpu else "cuda")
    gemm, g = select_int8_gemm("auto"), torch.Generator(device).manual_seed(0)
    layers = {"out_proj": (5376, 7168), "fc2": (5376, 14336)} if not a.cpu else {"out_proj": (256, 1024)}
    tokens = 64 if a.cpu else a.tokens
    for name, (n, k) in layers.items():
        w = torch.randn(n, k, device=device, generator=g) / k**0.5
        q, s = quantize_int8_convrot(w)
        x = torch.randn(tokens, k, device=device, generator=g).to(torch.bfloat16)
        exact = x.float() @ (_dequantised(q, s)).T
        tp1 = local_linear(x, Int8Weight(q, s, 256), None, torch.float32, gemm)
        for dtype in (torch.float32, torch.bfloat16):
            halves = [local_linear(x[:, h * k // 2 : (h + 1) * k // 2].contiguous(), Int8Weight(q[:, h * k // 2 : (h + 1) * k // 2].contiguous(), s, 256),
                                   None, dtype, gemm) for h in (0, 1)]  # fmt: skip
            for w_name in (wire.EXACT, wire.INT8):
                tp2 = wire.sum_here(halves, w_name).float()
                row = dict(layer=name, tokens=tokens, reduce=str(dtype).replace("torch.", ""), wire=w_name,
                           tp2_vs_tp1_db=sqnr_db(tp1, tp2), tp2_vs_exact_db=sqnr_db(exact, tp2), tp1_vs_exact_db=sqnr_db(exact, tp1))  # fmt: skip
                print(json.dumps(row), flush=True)


def _dequantised(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The rotated int8 weight back in fp32, unrotated (ConvRot: a block-diagonal Hadamard of 256, its own inverse)."""
    from comfy_kitchen.backends.eager import quantization as eager

    h = eager._build_hadamard(256, device=q.device, dtype=torch.float32)
    rotated = q.float() * s.float()
    return (rotated.view(q.shape[0], -1, 256) @ h).view(q.shape)


if __name__ == "__main__":
    main()
