"""tp2/wire.py's int8 quantise and its rank-ordered dequantise-and-sum, each one Triton pass over a tile of a row.

Torch takes five or more passes over the partial sums for each; these read them once. The sum is q * s (exact in fp32:
an int8 times a bf16) added rank by rank in order, as torch's is, so both give the same bytes; the quantiser may round
a half the other way than torch's, which no rank can see: every rank sums the bytes that were sent. `select(device)`
is this module (quantize, dequant_sum) where both kernels run there (probed once: kernels/triton_probe.py), else None.
"""

from __future__ import annotations

import sys

import torch

from . import triton_probe
from .triton_probe import tl, triton

TILE = 1024  # columns a program takes: a multiple of tp2.wire's group (the group is read off the scales' shape)


def select(device: torch.device):
    return sys.modules[__name__] if triton_probe.runs("wire_codec", device, torch.float32, _probe) else None


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    q = torch.empty((1, 2, TILE), dtype=torch.int8, device=device)
    s = torch.empty((1, 2, TILE // 64), dtype=torch.bfloat16, device=device)
    quantize(torch.randn((2, TILE), device=device, dtype=dtype), q[0], s[0])
    dequant_sum(q, s, dtype)


if triton is not None:

    @triton.jit
    def _quantize(x_ptr, q_ptr, s_ptr, sx, sq, ss, n, G: tl.constexpr, TILE: tl.constexpr):
        row, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * TILE + tl.arange(0, TILE)
        x = tl.load(x_ptr + row * sx + cols, mask=cols < n, other=0.0).to(tl.float32).reshape(TILE // G, G)
        scale = (tl.max(tl.abs(x), axis=1) / 127).to(tl.bfloat16)
        groups = tl.program_id(1) * (TILE // G) + tl.arange(0, TILE // G)
        tl.store(s_ptr + row * ss + groups, scale, mask=groups < n // G)
        v = tl.floor(x / tl.maximum(scale.to(tl.float32), 1e-30)[:, None] + 0.5)
        tl.store(q_ptr + row * sq + cols, tl.minimum(tl.maximum(v, -127), 127).reshape(TILE).to(tl.int8), mask=cols < n)

    @triton.jit
    def _dequant_sum(q_ptr, s_ptr, y_ptr, rq, sq, rs, ss, sy, n, RANKS: tl.constexpr, G: tl.constexpr, TILE: tl.constexpr):
        row, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * TILE + tl.arange(0, TILE)
        groups = tl.program_id(1) * (TILE // G) + tl.arange(0, TILE // G)
        total = tl.zeros((TILE,), dtype=tl.float32)
        for r in tl.static_range(RANKS):
            s = tl.load(s_ptr + r * rs + row * ss + groups, mask=groups < n // G, other=0.0).to(tl.float32)
            v = tl.load(q_ptr + r * rq + row * sq + cols, mask=cols < n, other=0).to(tl.float32)
            term = (v.reshape(TILE // G, G) * s[:, None]).reshape(TILE)
            total = term if r == 0 else total + term  # not 0 + term: -0.0 stays -0.0, as in torch's sum
        tl.store(y_ptr + row * sy + cols, total.to(y_ptr.dtype.element_ty), mask=cols < n)


def quantize(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """tp2.wire.quantize in one pass: rows `x` [M, N] (contiguous columns) into `q` and `s` (row views)."""
    m, n = x.shape
    if m:
        _quantize[(m, triton.cdiv(n, TILE))](x, q, s, x.stride(0), q.stride(0), s.stride(0), n, G=n // s.shape[1], TILE=TILE)


def dequant_sum(qs: torch.Tensor, ss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tp2.wire.dequant_sum in one pass: `qs` [ranks, M, N], `ss` [ranks, M, N / GROUP] (row views)."""
    ranks, m, n = qs.shape
    y = torch.empty((m, n), dtype=dtype, device=qs.device)
    if m:
        _dequant_sum[(m, triton.cdiv(n, TILE))](
            qs, ss, y, qs.stride(0), qs.stride(1), ss.stride(0), ss.stride(1), y.stride(0), n, RANKS=ranks, G=n // ss.shape[2], TILE=TILE
        )
    return y
