"""What the ranks send each other to sum the DiT's row-parallel partial sums (TP2_WIRE), and the sum it gives.

    exact  the collective itself, in the partial sums' dtype (TP2_REDUCE_DTYPE): all-reduce, or reduce-scatter
    int8   each rank quantises its partial sums in groups of GROUP columns of a row (one bf16 scale a group), the ranks
           exchange the bytes (all-gather; for a reduce-scatter, all-to-all of each rank's rows), and every rank sums
           the dequantised terms in rank order, its own from the bytes it sent: every rank holds the same bytes by
           construction. A group never crosses a row, so chunks of rows give the bytes of the whole.
At two ranks int8 sends about half the bytes of a bf16 all-reduce; the exchange is one-shot, so at more ranks it saves
nothing and is refused. A 4-bit wire was built and measured (docs/PERFORMANCE.md, A link without NVLink): 21 dB worse
per layer, far past the 2 dB a wire may cost, so it is not offered. Quantise and sum: torch here, or the fused kernels
nodes register (kernels/wire_codec.py) where they run. Imports torch only; never `comfy`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from .collectives import Pending, TPGroup, all_reduce, start_all_gather_rows, start_all_to_all_rows, start_reduce_scatter_rows

EXACT, INT8 = "exact", "int8"
GROUP = 64  # columns of a row sharing one scale
# bytes a summed element puts on a two-rank link, against an all-reduce's element size (tp2/link.py's model)
WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, INT8: 1 + 2 / GROUP}


def quantize(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """Rows `x` [M, N] into `q` [M, N] int8 and `s` [M, N / GROUP] bf16: s = the group's largest |x| / 127,
    q = round(x / s)."""
    xg = x.float().view(x.shape[0], -1, GROUP)
    s.copy_(xg.abs().amax(-1) / 127)
    q.copy_((xg / s.float().clamp_min(1e-30).unsqueeze(-1)).round().clamp(-127, 127).view(x.shape))


def dequant_sum(qs: torch.Tensor, ss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_r q_r * s_r in fp32, rank by rank in order, as `dtype` [M, N]: `qs` [ranks, M, N], `ss` [ranks, M, N / GROUP]."""
    total = None
    for q, s in zip(qs, ss):
        term = q.float().view(q.shape[0], -1, GROUP) * s.float().unsqueeze(-1)
        total = term if total is None else total + term
    return total.view(qs.shape[1], -1).to(dtype)


TORCH = SimpleNamespace(quantize=quantize, dequant_sum=dequant_sum)  # the codec where no fused one runs
_fused: list[Callable] = [lambda device: None]


def use_fused(select: Callable) -> None:
    """Fused kernels where `select(device)` gives them (a module like kernels/wire_codec.py, or None), not torch's ops."""
    _fused[0] = select


def _views(buf: torch.Tensor, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows of bytes [ranks, q | s] as (q [ranks, m, n] int8, s [ranks, m, n / GROUP] bf16)."""
    k = buf.shape[0]
    return buf[:, : m * n].view(torch.int8).view(k, m, n), buf[:, m * n :].view(torch.bfloat16).view(k, m, -1)


def _packed(rows: list[torch.Tensor], codec) -> torch.Tensor:
    """Each of `rows` ([m, N] alike) quantised into one row of bytes [len(rows), q | s]: what a rank sends."""
    m, n = rows[0].shape
    buf = torch.empty((len(rows), m * n + 2 * m * n // GROUP), dtype=torch.uint8, device=rows[0].device)
    for t, q, s in zip(rows, *_views(buf, m, n)):
        codec.quantize(t, q, s)
    return buf


def sum_here(parts: list[torch.Tensor], wire: str) -> torch.Tensor:
    """What start_sum gives every rank for these partial sums [M, N], one per rank, all held in this process (the
    numerics check's ranks)."""
    if wire == EXACT or parts[0].shape[-1] % GROUP:
        return sum(parts[1:], parts[0])
    codec = _fused[0](parts[0].device) or TORCH
    return codec.dequant_sum(*_views(_packed(parts, codec), *parts[0].shape), parts[0].dtype)


def start_sum(t: torch.Tensor, tp: TPGroup, wire: str, dtype: torch.dtype, scatter: bool) -> Pending:
    """The sum over the ranks of `t` [..., N] in `dtype`, started: all of it (all-reduce), or with `scatter` this
    rank's rows of `t` [rows, N] (reduce-scatter), through `wire`. Compressed only where N fills whole groups."""
    if wire == EXACT or tp.tp_size == 1 or t.shape[-1] % GROUP:
        return (start_reduce_scatter_rows(t, tp) if scatter else all_reduce(t, tp, wait=False)).then(lambda y: y.to(dtype))
    codec, shape, t = _fused[0](t.device) or TORCH, t.shape, t.reshape(-1, t.shape[-1])
    rows = t.chunk(tp.tp_size) if scatter else [t]
    sent = (start_all_to_all_rows if scatter else start_all_gather_rows)(_packed(rows, codec), tp)

    def summed(got: torch.Tensor) -> torch.Tensor:
        y = codec.dequant_sum(*_views(got, *rows[0].shape), dtype)
        return y if scatter else y.view(*shape[:-1], -1)

    return sent.then(summed)
