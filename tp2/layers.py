"""Parallel linears over local weight slices: float or int8 (ConvRot) weights, each layer with a TP role.

    ColumnParallelLinear  Y_r = X A_r, A split by output rows (per packed part). forward: no collective.
    RowParallelLinear     Y = sum_r X_r A_r, A split by input columns. forward: all-reduce(sum) in fp32, then cast.
    ReplicatedLinear      Y = X A on every rank. forward: no collective.

The int8 GEMM is injected (`kernels.select_int8_gemm()`), so this module depends on torch only.
Imports nothing from `comfy`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import convrot_group
from .collectives import TPGroup, all_reduce
from .errors import MissingRoleError
from .plan import COLWISE, COLWISE_PACKED, REPLICATE, ROWWISE, ROWWISE_SPLIT_INPUT, Plan
from .sequence_layout import RowLayout, reduce_scatter_sequence

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


def weight_from_state_dict(sd: dict[str, torch.Tensor], prefix: str) -> LinearWeight:
    """The weight of layer `prefix` (e.g. 'blocks.0.mlp.fc2.') as float tensor or Int8Weight."""
    marker = sd.get(prefix + "comfy_quant")
    if marker is None:
        return sd[prefix + "weight"]
    conf = json.loads(bytes(marker.cpu().numpy().tobytes()))
    return Int8Weight(sd[prefix + "weight"], sd[prefix + "weight_scale"].float(), convrot_group(conf))


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


class _TPLinear(nn.Module):
    tp_role = "replicate"

    def __init__(self, weight: LinearWeight, bias: torch.Tensor | None, tp: TPGroup, gemm=None):
        super().__init__()
        self.weight, self.bias, self.tp, self.gemm = weight, bias, tp, gemm


class ReplicatedLinear(_TPLinear):
    """Y = X A on every rank (the whole weight). forward: no collective."""

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        return local_linear(x, self.weight, self.bias, x.dtype, self.gemm, input_act)


class ColumnParallelLinear(_TPLinear):
    """Y_r = X A_r, A split by output rows (each packed part split alike). forward: no collective.

    The output holds this rank's columns of Y (for packed layers: its slice of each part, parts in order).
    """

    tp_role = "colwise"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return local_linear(x, self.weight, self.bias, x.dtype, self.gemm)


class RowParallelLinear(_TPLinear):
    """Y = sum_r X_r A_r, A split by input columns K. forward: all-reduce(sum) in fp32 (or `reduce_dtype`), then cast;
    or the reduction passed to forward (see row_parallel).

    Each rank quantises its own half-row of activations (int8), so the sum is exact math on a different
    quantisation grid than one GPU. The bias lives on rank 0 (zeros elsewhere) and is therefore added once.
    With `split_input` the input is replicated and each rank takes its K slice first (adaln in full form).
    """

    tp_role = "rowwise"

    def __init__(self, weight, bias, tp, gemm=None, split_input: bool = False, reduce_dtype: torch.dtype = torch.float32):
        super().__init__(weight, bias, tp, gemm)
        self.split_input, self.reduce_dtype = split_input, reduce_dtype

    def forward(self, x: torch.Tensor, input_act: str | None = None, reduce: Reduction = ALL_REDUCE) -> torch.Tensor:
        if self.split_input:
            x = split_input_slice(x, weight_k(self.weight), self.tp.tp_rank)
        return row_parallel(x, self.weight, self.bias, self.tp, self.gemm, self.reduce_dtype, input_act, reduce)


def split_input_slice(x: torch.Tensor, k: int, tp_rank: int) -> torch.Tensor:
    """This rank's K slice of a replicated input (a split-input row-parallel layer)."""
    return x.narrow(-1, tp_rank * k, k)


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
    ALL_REDUCE -> Y on every rank; a RowLayout -> this rank's rows of Y, reduce-scattered piece by piece over the
    sequence rows of `x` (each piece's collective in flight while the next computes); PARTIAL -> the partial sum.
    Reduced results are cast to x's dtype. Contract: forward: the reduction named; every rank calls it alike."""

    def partial(rows: torch.Tensor) -> torch.Tensor:
        return local_linear(rows, weight, bias, reduce_dtype, gemm, input_act)

    if isinstance(reduce, RowLayout):
        p = reduce.piece_rows
        return reduce_scatter_sequence(lambda c: partial(x[c * p : c * p + reduce.valid_rows(c)]), reduce, tp).to(x.dtype)
    if reduce == PARTIAL:
        return partial(x)
    if reduce != ALL_REDUCE:
        raise ValueError(f"unknown reduction {reduce!r} (ALL_REDUCE, PARTIAL or a RowLayout)")
    return all_reduce(partial(x), tp).to(x.dtype)


def weight_k(weight: LinearWeight) -> int:
    return (weight.qdata if isinstance(weight, Int8Weight) else weight).shape[1]


def build_linear(plan: Plan, layer: str, sd: dict[str, torch.Tensor], tp: TPGroup, gemm=None, reduce_dtype=torch.float32) -> _TPLinear:
    """The parallel linear for plan layer `layer` (no prefix) from this rank's state dict."""
    prefix = plan.prefix + layer + "."
    weight = weight_from_state_dict(sd, prefix)
    bias = sd.get(prefix + "bias")
    style = plan.linears[layer]
    if style in (COLWISE, COLWISE_PACKED):
        return ColumnParallelLinear(weight, bias, tp, gemm)
    if style in (ROWWISE, ROWWISE_SPLIT_INPUT):
        return RowParallelLinear(weight, bias, tp, gemm, split_input=style == ROWWISE_SPLIT_INPUT, reduce_dtype=reduce_dtype)
    if style == REPLICATE:
        return ReplicatedLinear(weight, bias, tp, gemm)
    raise ValueError(f"Unknown style '{style}' for '{layer}'.")


def require_role(module: nn.Module, name: str) -> str:
    """The module's TP role; raises MissingRoleError if a linear inside a TP model has none.

    Without a role a row-parallel layer would skip its all-reduce and give a plausible, wrong video.
    """
    role = getattr(module, ROLE_ATTR, None)
    if role not in ROLES:
        raise MissingRoleError(
            f"Linear '{name}' ran inside a tensor-parallel model without a TP role ({ROLE_ATTR}={role!r}). Its output "
            "would miss an all-reduce or use the wrong slice. The model was not prepared by the TP loader: load it "
            "with the stock 'Load Diffusion Model' node while the pack is active, or report the layer name."
        )
    return role
