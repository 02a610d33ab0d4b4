"""What the ranks send each other to sum the DiT's row-parallel partial sums (TP2_WIRE), and the sum it gives.

    exact      the collective itself, in the partial sums' dtype (TP2_REDUCE_DTYPE): all-reduce, or reduce-scatter
    int8/int4  each rank quantises its partial sums in groups of a row (one bf16 scale a group), the ranks exchange the
               bytes (all-gather; for a reduce-scatter, all-to-all of each rank's rows), and every rank sums the
               dequantised terms in rank order, its own from the bytes it sent: every rank holds the same bytes by
               construction. A group never crosses a row, so chunks of rows give the bytes of the whole.
At two ranks, int8 sends half the bytes of a bf16 all-reduce and int4 about a quarter; the exchange is one-shot, so at
more ranks it saves nothing and is refused. Quantise and sum: torch here, or the fused kernels nodes register
(kernels/wire_codec.py) where they run. Imports torch only; never `comfy`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .collectives import Pending, TPGroup, all_reduce, start_all_gather_rows, start_all_to_all_rows, start_reduce_scatter_rows
from .settings import SettingError

EXACT = "exact"


@dataclass(frozen=True)
class Format:
    qmax: int  # values -qmax..qmax
    group: int  # columns of a row sharing one scale
    per_byte: int  # values a byte holds


FORMATS = {"int8": Format(127, 64, 1), "int4": Format(7, 32, 2)}
# bytes a summed element puts on a two-rank link, against an all-reduce's element size (tp2/link.py's model)
WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, **{n: 1 / f.per_byte + 2 / f.group for n, f in FORMATS.items()}}


def wire_for(name: str, tp_size: int) -> str:
    """TP2_WIRE's value checked against the group: compressed only at two ranks."""
    if name != EXACT and tp_size != 2:
        raise SettingError(f"TP2_WIRE={name} needs exactly 2 ranks (one-shot exchange; at {tp_size} it sends no fewer bytes). Unset it.")
    return name


def quantize(x: torch.Tensor, fmt: Format, q: torch.Tensor, s: torch.Tensor) -> None:
    """Rows `x` [M, N] into `q` [M, N / per_byte] uint8 (int4: two values a byte, the even column low) and `s`
    [M, N / group] bf16, q = round(x / s) within +-qmax, s = the group's largest |x| / qmax."""
    m, n = x.shape
    xg = x.float().view(m, -1, fmt.group)
    s.copy_(xg.abs().amax(-1) / fmt.qmax)
    v = (xg / s.float().clamp_min(1e-30).unsqueeze(-1)).round().clamp(-fmt.qmax, fmt.qmax).to(torch.int16).view(m, n)
    if fmt.per_byte == 2:
        v = (v[:, 0::2] + 8) | ((v[:, 1::2] + 8) << 4)
    q.copy_(v.to(torch.int8 if fmt.per_byte == 1 else torch.uint8).view(torch.uint8))


def dequant_sum(qs: torch.Tensor, ss: torch.Tensor, fmt: Format, dtype: torch.dtype) -> torch.Tensor:
    """sum_r q_r * s_r in fp32, rank by rank in order, as `dtype` [M, N]: `qs` [n, M, N / per_byte], `ss` [n, M, N / group]."""
    total = None
    for q, s in zip(qs, ss):
        v = q.view(torch.int8) if fmt.per_byte == 1 else torch.stack(((q & 15).to(torch.int8) - 8, (q >> 4).to(torch.int8) - 8), -1)
        term = v.float().view(q.shape[0], -1, fmt.group) * s.float().unsqueeze(-1)
        total = term if total is None else total + term
    return total.view(qs.shape[1], -1).to(dtype)


TORCH = SimpleNamespace(quantize=quantize, dequant_sum=dequant_sum)  # the codec where no fused one runs
_fused: list[Callable] = []


def use_fused(select: Callable) -> None:
    """Fused kernels where `select(device, formats)` gives them (kernels.wire_codec.select), instead of torch's ops."""
    _fused[:] = [select]


def _codec(device: torch.device):
    return next((c for c in (f(device, FORMATS.values()) for f in _fused) if c is not None), TORCH)


def _packed(rows: list[torch.Tensor], fmt: Format, codec) -> torch.Tensor:
    """Each of `rows` ([m, N] alike) quantised into one row of bytes [len(rows), q | s]: what a rank sends."""
    (m, n), qn = rows[0].shape, rows[0].numel() // fmt.per_byte
    buf = torch.empty((len(rows), qn + 2 * m * n // fmt.group), dtype=torch.uint8, device=rows[0].device)
    for r, t in enumerate(rows):
        codec.quantize(t, fmt, buf[r, :qn].view(m, -1), buf[r, qn:].view(torch.bfloat16).view(m, -1))
    return buf


def _summed(got: torch.Tensor, m: int, n: int, fmt: Format, codec, dtype: torch.dtype) -> torch.Tensor:
    """The sum [m, n] of every rank's packed rows `got` [ranks, q | s], in rank order."""
    k, qn = got.shape[0], m * n // fmt.per_byte
    return codec.dequant_sum(got[:, :qn].view(k, m, -1), got[:, qn:].view(torch.bfloat16).view(k, m, -1), fmt, dtype)


def sum_here(parts: list[torch.Tensor], wire: str) -> torch.Tensor:
    """What start_sum gives every rank for these partial sums [M, N], one per rank, all held in this process (the
    numerics check's ranks)."""
    fmt = FORMATS.get(wire)
    if fmt is None or parts[0].shape[-1] % fmt.group:
        return sum(parts[1:], parts[0])
    codec = _codec(parts[0].device)
    return _summed(_packed(parts, fmt, codec), *parts[0].shape, fmt, codec, parts[0].dtype)


def start_sum(t: torch.Tensor, tp: TPGroup, wire: str, dtype: torch.dtype, scatter: bool) -> Pending:
    """The sum over the ranks of `t` [..., N] in `dtype`, started: all of it (all-reduce), or with `scatter` this
    rank's rows of `t` [rows, N] (reduce-scatter), through `wire`. Compressed only where N fills whole groups."""
    fmt = FORMATS.get(wire)
    if fmt is None or tp.tp_size == 1 or t.shape[-1] % fmt.group:
        return (start_reduce_scatter_rows(t, tp) if scatter else all_reduce(t, tp, wait=False)).then(lambda y: y.to(dtype))
    codec, shape, t = _codec(t.device), t.shape, t.reshape(-1, t.shape[-1])
    rows = t.chunk(tp.tp_size) if scatter else [t]
    sent = (start_all_to_all_rows if scatter else start_all_gather_rows)(_packed(rows, fmt, codec), tp)

    def summed(got: torch.Tensor) -> torch.Tensor:
        y = _summed(got, rows[0].shape[0], shape[-1], fmt, codec, dtype)
        return y if scatter else y.view(*shape[:-1], -1)

    return sent.then(summed)
