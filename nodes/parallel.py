"""TP roles on ComfyUI's H3 modules and the row-parallel call that replaces their forward.

tag_and_verify gives every linear its plan role and checks the built widths and the int8 layout; rowwise_call and
full_precision_rowwise_call run a row-parallel linear through tp2.layers.row_parallel (this rank's GEMM, then the
reduction); Int8Rows are a linear's input quantised elsewhere, multiplied here. Column-parallel and replicated
linears keep ComfyUI's own forward: their math is unchanged by TP.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass

import comfy.model_management
import comfy.ops
import torch
from comfy_kitchen.tensor import QuantizedTensor, TensorWiseINT8Layout

from ..kernels.int8_split import SplitInt8Linear, split_int8_linear
from ..tp2.errors import MissingRoleError, PlanError
from ..tp2.layers import ALL_REDUCE, ROLE_ATTR, Int8Weight, Reduction, require_role, row_parallel
from ..tp2.plan import COLWISE, COLWISE_PACKED, REPLICATE, ROWWISE, ROWWISE_SPLIT_INPUT, Plan
from .patches import PATCHES, changes_of
from .state import STATE

ROLE_OF_STYLE = {COLWISE: "colwise", COLWISE_PACKED: "colwise", ROWWISE: "rowwise", ROWWISE_SPLIT_INPUT: "rowwise", REPLICATE: "replicate"}
_in_tp_forward = threading.local()


def _is_comfy_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, comfy.ops.CastWeightBiasOp) and type(module).__name__ == "Linear"


def planned_linears(model: torch.nn.Module, linears: dict[str, str], what: str):
    """(name, module, plan style) of every ComfyUI linear in `model`, each given its role; PlanError for one the plan never saw."""
    for name, module in model.named_modules():
        if not _is_comfy_linear(module):
            continue
        style = linears.get(name)
        if style is None:
            raise PlanError(
                f"{STATE.tag} the built {what} has a linear '{name}' the plan never saw: refused. Report this with your ComfyUI version."
            )
        setattr(module, ROLE_ATTR, ROLE_OF_STYLE[style])
        yield name, module, style


def tp_group():
    """The process group of the TP sampling run in progress (MissingRoleError outside one)."""
    session = STATE.session
    if session is None or session.group is None:
        raise MissingRoleError(
            f"{STATE.tag} a row-parallel layer ran outside a TP sampling run (no process group). Run it through a sampler node."
        )
    return session.group


def rowwise_call(
    linear: torch.nn.Module, x: torch.Tensor, input_act: str | None = None, reduce: Reduction = ALL_REDUCE, held=None
) -> torch.Tensor:
    """ComfyUI's row-parallel linear through tp2.layers.row_parallel, reduced as `reduce` says. `held`: the weight
    from held_weight(linear, ...), for a caller that calls it on several row chunks."""
    if getattr(linear, "tp_input_range", None):  # a split-input layer: this rank's K slice of a replicated input
        x = x.narrow(-1, *linear.tp_input_range)
    with contextlib.nullcontext(held) if held is not None else held_weight(linear, x) as (weight, bias):
        return row_parallel(x, weight, bias, tp_group(), STATE.int8_gemm, STATE.reduce_dtype, input_act, reduce)


def full_precision_rowwise_call(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's full-precision forward of a row-parallel linear (the text encoder's) through row_parallel: AWQ
    smoothing by this rank's K slice of pre_quant_scale, the weight cast without requantising, to the wider of x's
    dtype and the reduce dtype (in the encoder's fp32: ComfyUI's own cast and GEMM, bit for bit)."""
    comfy.ops.run_every_op()
    smooth = getattr(linear, "pre_quant_scale", None)
    if smooth is not None:
        x = x * comfy.model_management.cast_to_device(smooth, x.device, x.dtype)
    with held_weight(linear, x, torch.promote_types(x.dtype, STATE.reduce_dtype), want_requant=False) as (weight, bias):
        return row_parallel(x, weight, bias, tp_group(), STATE.int8_gemm, STATE.reduce_dtype)


@contextlib.contextmanager
def held_weight(linear: torch.nn.Module, like, dtype: torch.dtype | None = None, want_requant: bool = True):
    """ComfyUI's cast of `linear`'s weight and bias for inputs like `like` (a tensor, or Int8Rows: the weight-only-quant
    cast), held until the block ends: yields (the core's LinearWeight, int8 plain tensors or float, bias)."""
    if isinstance(like, Int8Rows):
        cast = comfy.ops.cast_bias_weight(
            linear, None, dtype=linear.weight.dtype, device=like.qdata.device, bias_dtype=like.dtype,
            offloadable=True, compute_dtype=like.dtype, want_requant=True,
        )  # fmt: skip
    else:
        cast = comfy.ops.cast_bias_weight(linear, like, dtype, offloadable=True, compute_dtype=like.dtype, want_requant=want_requant)
    weight, bias, offload_stream = cast
    try:
        if isinstance(weight, QuantizedTensor) and weight._layout_cls == "TensorWiseINT8Layout":
            qdata, scale = TensorWiseINT8Layout.get_plain_tensors(weight)
            yield Int8Weight(qdata, scale, weight._params.convrot_groupsize if getattr(weight._params, "convrot", False) else None), bias
        else:
            yield (weight.dequantize() if isinstance(weight, QuantizedTensor) else weight), bias
    finally:
        comfy.ops.uncast_bias_weight(linear, weight, bias, offload_stream)


@dataclass(frozen=True)
class Int8Rows:
    """A linear's input that arrived quantised: int8 rows [M, K] and fp32 row scales [M, 1] from `split.quantize`,
    standing for the `dtype` activation they were made from (shape and dtype read like that tensor's)."""

    qdata: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    split: SplitInt8Linear

    @property
    def shape(self) -> torch.Size:
        return self.qdata.shape

    def __getitem__(self, rows: slice) -> Int8Rows:
        return Int8Rows(self.qdata[rows], self.scale[rows], self.dtype, self.split)


def int8_weighted(linear: torch.nn.Module) -> bool:
    """Whether ComfyUI runs `linear` in int8 (its GEMM sums are exact integers row by row): not where a weight function
    (an unmerged LoRA) or full-precision matmuls make it dequantise."""
    w = linear.weight
    return (
        isinstance(w, QuantizedTensor) and w._layout_cls == "TensorWiseINT8Layout" and not linear.weight_function
        and not linear.bias_function and not getattr(linear, "_full_precision_mm", False)
        and not getattr(linear, "comfy_force_cast_weights", False)
    )  # fmt: skip


def int8_input_split(linear: torch.nn.Module, x: torch.Tensor) -> SplitInt8Linear | None:
    """The split int8 linear that gives ComfyUI's own forward of `linear` on rows like `x` bit for bit, or None where
    ComfyUI would not take its int8 path (see int8_weighted; a non-ConvRot weight) or comfy-kitchen's halves cannot
    be matched here."""
    w = linear.weight
    on_int8_path = int8_weighted(linear) and getattr(w._params, "convrot", False) and getattr(linear, "layout_type", None) is not None
    return split_int8_linear(x, tuple(w.shape), w._params.convrot_groupsize) if on_int8_path and x.shape[0] >= 2 else None


def int8_rows_call(linear: torch.nn.Module, rows: Int8Rows, held=None) -> torch.Tensor:
    """ComfyUI's int8 forward of `linear` (weight-only-quant path: the same cast, bias and output dtype) on rows
    that were quantised before they travelled. `held`: the weight from held_weight(linear, rows), as in rowwise_call."""
    comfy.ops.run_every_op()
    with contextlib.nullcontext(held) if held is not None else held_weight(linear, rows) as (local, bias):
        if not isinstance(local, Int8Weight) or local.qdata.shape[1] != rows.shape[1]:
            raise PlanError(
                f"{STATE.tag} a linear got int8 rows of width {rows.shape[1]} but its weight is "
                f"{type(local).__name__} {tuple(getattr(local, 'qdata', local).shape)}: the weight changed after the input "
                "was quantised (a patch applied mid-run?). Unset TP2_SEQUENCE_PARALLEL on every rank and report this."
            )
        return rows.split.gemm(rows.qdata, rows.scale, local.qdata, local.scale, bias, rows.dtype)


def int8_rows_or_own(linear, own, x, *args, **kwargs):
    """The forward of a column-parallel ComfyUI linear that takes Int8Rows as well as tensors (tensors go to `own`)."""
    return int8_rows_call(linear, x) if isinstance(x, Int8Rows) else own(x, *args, **kwargs)


def _hooked_linear_input_act(original):
    """comfy.ops.linear_input_act for TP models: row-parallel linears reduce; others run `original`."""

    @functools.wraps(original)
    def linear_input_act(linear, x, input_act, *args, **kwargs):
        role = getattr(linear, ROLE_ATTR, None)
        if role == "rowwise":
            return rowwise_call(linear, x, input_act)
        if role is None and getattr(_in_tp_forward, "depth", 0):
            require_role(linear, f"{type(linear).__name__} called through linear_input_act")
        return original(linear, x, input_act, *args, **kwargs)

    return linear_input_act


def tag_and_verify(dm: torch.nn.Module, plan: Plan) -> None:
    """Give every linear of the built model its plan role, replace row-parallel forwards, and check the build:
    PlanError when a width differs from the plan's, a linear is not in the plan, or int8 was dropped."""
    changes = changes_of(dm)
    for name, module, style in planned_linears(dm, plan.linears, "model"):
        if ROLE_OF_STYLE[style] == "rowwise" and plan.tp_size > 1:
            changes.replace(f"{name}.forward", module, "forward", lambda own, m=module: functools.partial(rowwise_call, m))
            if style == ROWWISE_SPLIT_INPUT:
                bounds, r = plan.tensors[plan.prefix + name + ".weight"].bounds, STATE.env.tp_rank
                module.tp_input_range = (bounds[r], bounds[r + 1] - bounds[r])  # (start, length)
        if plan.prefix + name + ".comfy_quant" in plan.tensors and not isinstance(module.weight, QuantizedTensor):
            raise PlanError(
                f"'{name}' is int8 in the checkpoint but ComfyUI loaded it as {type(module.weight).__name__}: the int8 path was "
                "dropped (another node pack passing custom_operations?). Disable that pack for H3 or report it."
            )
    counts = {"blocks": len(dm.blocks), "refiner blocks": len(dm.token_refiner.blocks)}
    why = "The checkpoint and the built model disagree; report this with the file name."
    refuse_widths("the model", counts, {"blocks": plan.num_layers, "refiner blocks": plan.refiner_layers}, why)
    want = {"heads": plan.local_heads(STATE.env.tp_rank), "fc1 rows": 2 * plan.local_ffn(STATE.env.tp_rank)}
    why = f"(tp_size={plan.tp_size}) The loaded state dict was not this rank's shard; restart the rank and report the log."
    for where, blocks in (("blocks", dm.blocks), ("token_refiner.blocks", dm.token_refiner.blocks)):
        for i, block in enumerate(blocks):
            built = {"heads": block.attn.heads, "fc1 rows": int(block.mlp.fc1.weight.shape[0])}  # a QuantizedTensor: its logical shape
            refuse_widths(f"{where}.{i}", built, want, why)


def refuse_widths(where: str, built: dict, want: dict, why: str) -> None:
    """PlanError when ComfyUI built `where` with other widths than this rank's plan needs."""
    if built != want:
        raise PlanError(f"{STATE.tag} {where}: ComfyUI built {built}, this rank's plan needs {want}. {why}")


def _check_module(module, args):
    if _is_comfy_linear(module) and getattr(module, ROLE_ATTR, None) is None:
        require_role(module, type(module).__qualname__)


@contextlib.contextmanager
def role_guard():
    """While active, any ComfyUI linear that runs without a TP role raises MissingRoleError (fail closed)."""
    _in_tp_forward.depth = getattr(_in_tp_forward, "depth", 0) + 1
    handle = torch.nn.modules.module.register_module_forward_pre_hook(_check_module)
    try:
        yield
    finally:
        handle.remove()
        _in_tp_forward.depth -= 1


def install_linear_input_act_patch() -> None:
    """comfy.ops.linear_input_act is looked up at call time by H3's MLP, so patching the module attribute suffices."""
    PATCHES.install(comfy.ops, "linear_input_act", _hooked_linear_input_act)
