"""The TP core's linear on this rank's weight slice (float, or int8 ConvRot), and the row-parallel sum.

    column-parallel  Y_r = X A_r, A split by output rows (per packed part): the local GEMM, no collective
    row-parallel     Y = sum_r X_r A_r, A split by input columns: row_parallel, partial sums in the reduce dtype
                     (fp32 by default), then all-reduce (or the reduction asked for), then cast
    replicated       Y = X A on every rank: the local GEMM, no collective

Each rank quantises its own half-row of activations (int8), so a row-parallel sum is exact math on a different
quantisation grid than one GPU. The bias lives on rank 0 (zeros elsewhere) and is therefore added once.
The int8 GEMM is injected (`kernels.select_int8_gemm()`), so this module depends on torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import TPGroup, all_reduce, start_reduce_scatter_rows
from .errors import MissingRoleError
from .sequence_layout import RowLayout, chunk_bounds

ROLE_ATTR = "tp_role"
ROLES = ("colwise", "rowwise", "replicate")
ALL_REDUCE = "all-reduce"  # row_parallel(reduce=...): every rank gets the whole sum
PARTIAL = "partial"  # row_parallel(reduce=...): this rank's partial sum, unreduced, in the reduce dtype
Reduction = str | RowLayout  # ALL_REDUCE, PARTIAL, or the RowLayout to reduce-scatter to


@dataclass
class Int8Weight:
    """An int8 weight as stored: qdata [N, K] int8 (ConvRot-rotated when `convrot_group`), per-row fp32 scale."""

    qdata: torch.Tensor
    scale: torch.Tensor
    convrot_group: int | None


LinearWeight = torch.Tensor | Int8Weight


def apply_input_act(x: torch.Tensor, input_act: str | None) -> torch.Tensor:
    if input_act is None:
        return x
    if input_act == "swiglu":  # H3's MLP: [gate | up] -> silu(gate) * up
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    raise ValueError(f"Unknown input activation '{input_act}' (known: swiglu).")


def local_linear(
    x: torch.Tensor,
    weight: LinearWeight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    gemm: Callable[..., torch.Tensor] | None,
    input_act: str | None = None,
) -> torch.Tensor:
    """This rank's GEMM on its slice: int8 through `gemm`, float through F.linear in the weight's dtype."""
    if isinstance(weight, Int8Weight):
        if gemm is None:
            raise ValueError("An int8 layer needs an int8 GEMM: pass kernels.select_int8_gemm().")
        return gemm(x, weight.qdata, weight.scale, bias, out_dtype, weight.convrot_group, input_act)
    x = apply_input_act(x, input_act).to(weight.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(weight.dtype)).to(out_dtype)


def row_parallel(
    x: torch.Tensor,
    weight: LinearWeight,
    bias: torch.Tensor | None,
    tp: TPGroup,
    gemm: Callable[..., torch.Tensor] | None,
    reduce_dtype: torch.dtype,
    input_act: str | None = None,
    reduce: Reduction = ALL_REDUCE,
) -> torch.Tensor:
    """Y = sum_r act(X)_r A_r from this rank's GEMM on its K slice, out in `reduce_dtype`, then `reduce`:
    ALL_REDUCE -> Y on every rank; a RowLayout -> this rank's rows of Y, reduce-scattered over the sequence rows of
    `x`; PARTIAL -> the partial sum. Reduced results are cast to x's dtype; every rank calls it alike."""

    def partial(rows: torch.Tensor) -> torch.Tensor:
        return local_linear(rows, weight, bias, reduce_dtype, gemm, input_act)

    if reduce == PARTIAL:
        return partial(x)
    int8 = isinstance(weight, Int8Weight)
    flat = int8 and tp.overlap > 1 and not isinstance(reduce, RowLayout)  # all-reduced in chunks of tokens
    rows = x.reshape(-1, x.shape[-1]) if flat else x
    y = reduced(lambda a, b: partial(rows[a:b]), rows.shape[0], tp, reduce, int8, x.dtype)
    return y.view(*x.shape[:-1], -1) if flat else y


def reduced(partial: Callable[[int, int], torch.Tensor], rows: int, tp: TPGroup, reduce: Reduction, overlap: bool, dtype) -> torch.Tensor:
    """The sum over the ranks of `partial(a, b)` (this rank's partial sums for input rows [a, b) of `rows`) in
    `dtype`, as `reduce` asks: ALL_REDUCE, or a RowLayout (this rank's rows). With `overlap` (int8 layers: a row's
    sums are exact integers whatever rows share its GEMM), in TP2_OVERLAP's chunks: each chunk's collective runs while
    the next chunk computes, and as two ranks' sum is a + b either way, the bytes are those of one collective."""
    chunks, lay = tp.overlap if overlap else 1, reduce if isinstance(reduce, RowLayout) else None
    if chunks == 1 and lay is not None:  # the unpadded partial sum is freed before the collective
        return start_reduce_scatter_rows(lay.pad(partial(0, lay.full)), tp).result().to(dtype)
    n, pending = lay.m if lay else rows, []
    for a, b in chunk_bounds(n, -(-n // chunks)):
        both = None if lay else partial(a, b)  # with a layout: sub-block [a, b) of every rank's rows, reduce-scattered
        for r in range(lay.size if lay else 0):
            lo, hi = r * lay.m + a, min(r * lay.m + b, lay.full)  # rows past `full` are pad rows: zero sums
            if hi > lo:
                y = partial(min(lo, max(0, hi - 2)), hi)[lo - hi :]  # a 1-row GEMM would take another kernel path
                both = y.new_zeros((lay.size * (b - a), y.shape[1])) if both is None else both
                both[r * (b - a) : r * (b - a) + hi - lo] = y
        pending.append((a, b, start_reduce_scatter_rows(both, tp) if lay else all_reduce(both, tp, wait=False)))
    if len(pending) == 1:
        return pending[0][2].result().to(dtype)
    out = None
    for a, b, p in pending:
        y = p.result()
        out = y.new_empty((n, *y.shape[1:]), dtype=dtype) if out is None else out
        out[a:b] = y
    return out


def require_role(module: nn.Module, name: str) -> str:
    """The module's TP role; raises MissingRoleError if a linear inside a TP model has none (without a role a
    row-parallel layer would skip its all-reduce and give a plausible, wrong video)."""
    role = getattr(module, ROLE_ATTR, None)
    if role not in ROLES:
        raise MissingRoleError(
            f"Linear '{name}' ran inside a tensor-parallel model without a TP role ({ROLE_ATTR}={role!r}). Its output "
            "would miss an all-reduce or use the wrong slice. The model was not prepared by the TP loader: load it "
            "with the stock 'Load Diffusion Model' node while the pack is active, or report the layer name."
        )
    return role
