"""tp2/wire.py's quantise and rank-ordered dequantise-and-sum, each one Triton pass over a tile of a row.

Torch takes five to eight passes over the partial sums for each; these read them once. The sum is q * s (exact in
fp32: an int8 times a bf16) added rank by rank in order, as torch's is, so both give the same bytes; the quantiser
may round a half differently than torch's, which no rank can see: every rank sums the bytes that were sent.
`select(device, formats)` is the codec where both kernels run (probed once; kernels/triton_probe.py), else None.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import triton_probe
from .triton_probe import tl, triton

TILE = 1024  # columns a program takes: a multiple of every format's group


def select(device: torch.device, formats=()) -> SimpleNamespace | None:
    """This module as tp2.wire's codec on `device`, once both kernels ran there for each of `formats`; else None."""

    def probe(device: torch.device, dtype: torch.dtype) -> None:
        x = torch.randn((2, TILE), device=device, dtype=dtype)
        for fmt in formats:
            q = torch.empty((1, 2, TILE // fmt.per_byte), dtype=torch.uint8, device=device)
            s = torch.empty((1, 2, TILE // fmt.group), dtype=torch.bfloat16, device=device)
            quantize(x, fmt, q[0], s[0])
            dequant_sum(q, s, fmt, dtype)

    ok = triton_probe.runs("wire_codec", device, torch.float32, probe)
    return SimpleNamespace(quantize=quantize, dequant_sum=dequant_sum) if ok else None


if triton is not None:

    @triton.jit
    def _quantize(x_ptr, q_ptr, s_ptr, sx, sq, ss, n, QMAX: tl.constexpr, G: tl.constexpr, PER_BYTE: tl.constexpr):
        row, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = tile * 1024 + tl.arange(0, 1024)
        x = tl.load(x_ptr + row * sx + cols, mask=cols < n, other=0.0).to(tl.float32).reshape(1024 // G, G)
        scale = (tl.max(tl.abs(x), axis=1) / QMAX).to(tl.bfloat16)
        groups = tile * (1024 // G) + tl.arange(0, 1024 // G)
        tl.store(s_ptr + row * ss + groups, scale, mask=groups < n // G)
        v = x / tl.maximum(scale.to(tl.float32), 1e-30)[:, None]
        v = tl.minimum(tl.maximum(tl.floor(v + 0.5), -QMAX), QMAX).to(tl.int32).reshape(1024)
        if PER_BYTE == 2:
            lo, hi = tl.split(v.reshape(512, 2))
            byte = ((lo + 8) | ((hi + 8) << 4)).to(tl.uint8)
            at = tile * 512 + tl.arange(0, 512)
            tl.store(q_ptr + row * sq + at, byte, mask=at < n // 2)
        else:
            tl.store(q_ptr + row * sq + cols, v.to(tl.int8).to(tl.uint8, bitcast=True), mask=cols < n)

    @triton.jit
    def _dequant_sum(q_ptr, s_ptr, y_ptr, rq, sq, rs, ss, sy, n, RANKS: tl.constexpr, G: tl.constexpr, PER_BYTE: tl.constexpr):
        row, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
        groups = tile * (1024 // G) + tl.arange(0, 1024 // G)
        total = tl.zeros((1024,), dtype=tl.float32)
        for r in tl.static_range(RANKS):
            s = tl.load(s_ptr + r * rs + row * ss + groups, mask=groups < n // G, other=0.0).to(tl.float32)
            if PER_BYTE == 2:
                at = tile * 512 + tl.arange(0, 512)
                byte = tl.load(q_ptr + r * rq + row * sq + at, mask=at < n // 2, other=0).to(tl.int32)
                v = tl.join((byte & 15) - 8, (byte >> 4) - 8).reshape(1024)
            else:
                cols = tile * 1024 + tl.arange(0, 1024)
                v = tl.load(q_ptr + r * rq + row * sq + cols, mask=cols < n, other=0).to(tl.int8, bitcast=True)
            term = (v.to(tl.float32).reshape(1024 // G, G) * s[:, None]).reshape(1024)
            total = term if r == 0 else total + term
        cols = tile * 1024 + tl.arange(0, 1024)
        tl.store(y_ptr + row * sy + cols, total.to(y_ptr.dtype.element_ty), mask=cols < n)


def quantize(x: torch.Tensor, fmt, q: torch.Tensor, s: torch.Tensor) -> None:
    """tp2.wire.quantize in one pass: rows `x` [M, N] (contiguous columns) into `q` and `s` (row views)."""
    m, n = x.shape
    if m:
        grid = (m, triton.cdiv(n, TILE))
        _quantize[grid](x, q, s, x.stride(0), q.stride(0), s.stride(0), n, QMAX=fmt.qmax, G=fmt.group, PER_BYTE=fmt.per_byte)


def dequant_sum(qs: torch.Tensor, ss: torch.Tensor, fmt, dtype: torch.dtype) -> torch.Tensor:
    """tp2.wire.dequant_sum in one pass: `qs` [n, M, N / per_byte], `ss` [n, M, N / group] (row views)."""
    ranks, m, n = qs.shape[0], qs.shape[1], ss.shape[2] * fmt.group
    y = torch.empty((m, n), dtype=dtype, device=qs.device)
    if m:
        _dequant_sum[(m, triton.cdiv(n, TILE))](
            qs, ss, y, qs.stride(0), qs.stride(1), ss.stride(0), ss.stride(1), y.stride(0), n,
            RANKS=ranks, G=fmt.group, PER_BYTE=fmt.per_byte,
        )  # fmt: skip
    return y
