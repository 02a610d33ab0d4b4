"""The TP core's linear on this rank's weight slice (float, or int8 ConvRot), and the row-parallel sum.

    column-parallel  Y_r = X A_r, A split by output rows (per packed part): the local GEMM, no collective
    row-parallel     Y = sum_r X_r A_r, A split by input columns: row_parallel, partial sums in the reduce dtype
                     (fp32 by default), then summed over the wire (tp2/wire.py) as the reduction asks, then cast
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

from .collectives import TPGroup
from .errors import MissingRoleError
from .sequence_layout import RowLayout, chunk_bounds
from .wire import EXACT, start_sum

ROLE_ATTR = "tp_role"
ROLES = ("colwise", "rowwise", "replicate")
ALL_REDUCE = "all-reduce"  # row_parallel(reduce=...): every rank gets the whole sum
PARTIAL = "partial"  # row_parallel(reduce=...): this rank's partial sum, unreduced, in the reduce dtype
STARTED = "started"  # row_parallel(reduce=...): the all-reduce's chunks of rows started, [(a, b, Pending)]: see joined
Reduction = str | RowLayout  # ALL_REDUCE, PARTIAL, STARTED, or the RowLayout to reduce-scatter to


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
    flat = int8 and not isinstance(reduce, RowLayout)  # int8 rows are independent: all-reduced in chunks of tokens
    rows = x.reshape(-1, x.shape[-1]) if flat else x
    y = reduced(lambda a, b: partial(rows[a:b]), rows.shape[0], tp, reduce, int8, x.dtype)
    return y.view(*x.shape[:-1], -1) if flat and reduce != STARTED else y


def reduced(partial: Callable[[int, int], torch.Tensor], rows: int, tp: TPGroup, reduce: Reduction, int8: bool, dtype):
    """The sum over the ranks of `partial(a, b)` (this rank's partial sums for input rows [a, b) of `rows`) in
    `dtype`, as `reduce` asks: ALL_REDUCE, STARTED, or a RowLayout (this rank's rows). `int8` layers (a row's sums are
    exact integers whatever rows share its GEMM) go through TP2_WIRE and in TP2_OVERLAP's chunks, each chunk's
    collective running while the next chunk computes: the bytes of one collective (two ranks' sum is a + b either way;
    a wire's groups never cross a row)."""
    wire, chunks = (tp.wire, tp.overlap) if int8 else (EXACT, 1)
    lay = reduce if isinstance(reduce, RowLayout) else None
    if lay is None:
        started = [(a, b, start_sum(partial(a, b), tp, wire, dtype, False)) for a, b in chunk_bounds(rows, -(-rows // chunks))]
        return started if reduce == STARTED else joined(started)
    if chunks == 1:  # the unpadded partial sum is freed before the collective
        return start_sum(lay.pad(partial(0, lay.full)), tp, wire, dtype, True).result()
    spans = chunk_bounds(lay.m, -(-lay.m // chunks))  # sub-block [a, b) of every rank's rows, reduce-scattered
    return joined([(a, b, start_sum(lay.every_ranks_rows(partial, a, b), tp, wire, dtype, True)) for a, b in spans])


def joined(started: list) -> torch.Tensor:
    """The sums of `started` [(a, b, Pending)], the spans [a, b) of rows from 0 each started before the next was
    made (so it ran while that one computed), as one tensor."""
    if len(started) == 1:
        return started[0][2].result()
    out = None
    for a, b, p in started:
        y = p.result()
        out = y.new_empty((started[-1][1], *y.shape[1:])) if out is None else out
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
