"""The MiniMax-H3 tensor-parallel plan: which tensor each rank holds, resolved from a checkpoint layout.

The widths come from the checkpoint (tp2.h3_layout). Everything is validated here, before any weight is read or
any collective runs. Imports nothing from `comfy`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from dataclasses import dataclass

from .checkpoint import CheckpointLayout, convrot_group
from .errors import PlanError
from .h3_layout import H3Shape

COLWISE = "colwise"  # Y = X A, A split by output rows; no collective
COLWISE_PACKED = "colwise_packed"  # the same, per fused part ([q|k|v], [gate|up]): each rank its slice of each
ROWWISE = "rowwise"  # Y = sum_r X_r A_r, A split by input columns; all-reduce(sum) after
ROWWISE_SPLIT_INPUT = "rowwise_split_input"  # rowwise whose input is replicated: each rank slices it first
REPLICATE = "replicate"

ROW_PARALLEL = (ROWWISE, ROWWISE_SPLIT_INPUT)

# How one tensor of a rank file relates to the full tensor.
SPLIT = "split"  # narrowed along `dim` (per packed part)
WHOLE = "whole"  # identical on every rank
RANK0 = "rank0"  # a row-parallel bias: rank 0 holds it, other ranks hold zeros, so the reduce adds it once

# Megatron-style plan of the H3 DiT, by module-name pattern ("*" is a block index) -> (style, packed parts).
# Attention and MLP are split column-then-row, so each block needs two all-reduces and nothing else.
# `adaln_proj.linear` of the DiT blocks is resolved by checkpoint form (ADALN_STYLE).
ADALN = "blocks.*.adaln_proj.linear"
H3_TP_PLAN: dict[str, tuple[str, int]] = {
    "blocks.*.attn.qkv_proj": (COLWISE_PACKED, 3),  # [q|k|v]: each rank takes its heads from each part
    "blocks.*.attn.out_proj": (ROWWISE, 1),
    "blocks.*.mlp.fc1": (COLWISE_PACKED, 2),  # [gate|up]: each rank takes its half of each
    "blocks.*.mlp.fc2": (ROWWISE, 1),  # called via linear_input_act(..., "swiglu") in ComfyUI
    "token_refiner.blocks.*.attn.qkv_proj": (COLWISE_PACKED, 3),  # the refiner is built with the DiT's head count
    "token_refiner.blocks.*.attn.out_proj": (ROWWISE, 1),
    "token_refiner.blocks.*.mlp.fc1": (COLWISE_PACKED, 2),
    "token_refiner.blocks.*.mlp.fc2": (ROWWISE, 1),
    ADALN: (REPLICATE, 1),  # placeholder, resolved by form
}
# the full form's adaln is ~260 M params per block at full size: halve it per rank; the curve form's is ~1 M
ADALN_STYLE = {"curve": REPLICATE, "full": ROWWISE_SPLIT_INPUT}

# Replicated on purpose: patch/condition projections and the time embedder (small, consumed by every rank
# before the first block), norms and per-head q/k norms (per-channel weights), rope and the adaln curve table
# (buffers), the final layer (one small head run once per forward), and the DiT blocks' adaln in curve form
# (~1 M parameters per block). Listed so that an unknown tensor is an error instead of silently replicated.
H3_REPLICATED = (
    "video_patch_proj",
    "audio_patch_proj",
    "condition_proj",
    "time_embedder.proj_in",
    "time_embedder.proj_out",
    "blocks.*.norm1",
    "blocks.*.norm2",
    "blocks.*.attn.q_norm",
    "blocks.*.attn.k_norm",
    "token_refiner.blocks.*.norm1",
    "token_refiner.blocks.*.norm2",
    "token_refiner.blocks.*.attn.q_norm",
    "token_refiner.blocks.*.attn.k_norm",
    "token_refiner.final_norm",
    "final_layer.norm",
    "final_layer.adaln_proj.linear",
    "final_layer.video_out",
    "final_layer.audio_out",
)
H3_BUFFERS = ("adaln_t_table", "rope.inv_freq")
KNOWN_SUFFIXES = ("weight", "bias", "weight_scale", "comfy_quant")
SUPPORTED_QUANT_FORMATS = ("int8_tensorwise",)


def compile_pattern(pattern: str) -> re.Pattern:
    """A module-name pattern ("*" is a block index) as a regex matching whole names."""
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")


def plan_fingerprint(tp_size: int, rows: list[list]) -> str:
    """The short hash a plan is known by (rank-cache file names, the ranks' handshake): one row per tensor."""
    doc = {"tp_size": tp_size, "tensors": sorted(rows)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


_LINEAR_RULES = [(compile_pattern(p), p, style) for p, style in H3_TP_PLAN.items()]
_REPLICATED_RULES = [compile_pattern(p) for p in H3_REPLICATED]


@dataclass(frozen=True)
class TensorShard:
    """One tensor's place in the plan: how a rank's copy is cut from the full tensor."""

    name: str  # full key in the checkpoint (with prefix)
    kind: str  # SPLIT, WHOLE or RANK0
    dim: int | None  # SPLIT only
    parts: int  # packed parts along `dim` (1 when not packed)
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str
    layer_style: str  # style of the linear it belongs to, REPLICATE for non-linears


@dataclass(frozen=True)
class Plan:
    """The resolved plan for one checkpoint at one tp_size (identical on every rank)."""

    tp_size: int
    prefix: str
    adaln_form: str  # "full" (time_embedder + big adaln) or "curve" (adaln_t_table)
    hidden: int
    heads: int
    head_dim: int
    ffn: int
    num_layers: int
    refiner_layers: int
    linears: dict[str, str]  # every linear (2-D weight), by layer name without prefix -> style
    tensors: dict[str, TensorShard]

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp_size

    @property
    def local_ffn(self) -> int:
        return self.ffn // self.tp_size

    def fingerprint(self) -> str:
        rows = [[t.name, t.kind, t.dim, t.parts, list(t.full_shape), t.dtype] for t in self.tensors.values()]
        return plan_fingerprint(self.tp_size, rows)

    def summary(self) -> str:
        styles = ", ".join(f"{n} {s}" for s, n in sorted(Counter(self.linears.values()).items()))
        return (
            f"H3 tp_size={self.tp_size}: {self.num_layers} blocks + {self.refiner_layers} refiner, "
            f"heads {self.heads}->{self.local_heads}/rank, ffn {self.ffn}->{self.local_ffn}/rank, "
            f"adaln {self.adaln_form}-form; linears: {styles}; plan {self.fingerprint()}"
        )


def resolve_plan(layout: CheckpointLayout, tp_size: int) -> Plan:
    """Resolve and validate the plan; raises PlanError (with the tp_sizes that would work) on any problem."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}. Use the number of GPUs (ranks), e.g. 2.")
    plan, problems = _resolve(layout, tp_size)
    if problems:
        allowed = allowed_tp_sizes(layout)
        hint = f" Use tp_size {_join_or(allowed)}." if allowed else ""
        raise PlanError(problems[0] + hint)
    return plan


def allowed_tp_sizes(layout: CheckpointLayout, limit: int = 64) -> list[int]:
    """Every tp_size in 1..limit that this checkpoint can be split into."""
    return [n for n in range(1, limit + 1) if not _resolve(layout, n)[1]]


def _join_or(values: list[int]) -> str:
    s = [str(v) for v in values]
    return s[0] if len(s) == 1 else ", ".join(s[:-1]) + " or " + s[-1]


def _layer_style(module: str, adaln_style: str) -> tuple[str, int] | None:
    for rx, pattern, style in _LINEAR_RULES:
        if rx.match(module):
            return (adaln_style, 1) if pattern == ADALN else style
    return None


def _resolve(layout: CheckpointLayout, tp_size: int) -> tuple[Plan | None, list[str]]:
    dims = H3Shape.of(layout)
    prefix, form, adaln = dims.prefix, dims.adaln_form, ADALN_STYLE[dims.adaln_form]
    problems = _check_widths(dims.heads, dims.ffn, tp_size)
    linears: dict[str, str] = {}
    tensors: dict[str, TensorShard] = {}
    for name, (dtype, full) in layout.tensors.items():
        shard, linear_style, found = _place(layout.source, prefix, adaln, dims, tp_size, name, dtype, full)
        problems += found
        if shard:
            tensors[name] = shard
        if linear_style:
            linears[name[len(prefix) :].rpartition(".")[0]] = linear_style
    problems += _check_quant(layout, prefix, linears, tp_size)
    if problems:
        return None, problems
    num_layers = 1 + max(int(k.split(".")[1]) for k in linears if k.startswith("blocks."))
    refiner = [int(k.split(".")[2]) for k in linears if k.startswith("token_refiner.blocks.")]
    refiner_layers = 1 + max(refiner) if refiner else 0
    plan = Plan(tp_size, prefix, form, dims.hidden, dims.heads, dims.head_dim, dims.ffn, num_layers, refiner_layers, linears, tensors)
    return plan, []


def _place(src, prefix, adaln, dims: H3Shape, tp_size, name, dtype, full) -> tuple[TensorShard | None, str | None, list[str]]:
    """Tensor `name`'s place in the plan, its linear's style when it is a linear's 2-D weight, and what is wrong."""
    if not name.startswith(prefix):
        return None, None, [f"Tensor '{name}' in '{src}' is outside the H3 model (prefix '{prefix}'). Use a diffusion-model-only H3 file."]
    key = name[len(prefix) :]
    if key in H3_BUFFERS:
        return TensorShard(name, WHOLE, None, 1, full, full, dtype, REPLICATE), None, []
    module, _, suffix = key.rpartition(".")
    style = _layer_style(module, adaln)
    unplanned = _unplanned(key, module, suffix, style, src)
    if unplanned:
        return None, None, [unplanned]
    style, parts = style or (REPLICATE, 1)
    problems = _check_block_shape(key, module, full, dims, src)
    shard, problem = _tensor_shard(name, module, suffix, dtype, full, style, parts, tp_size)
    return shard, style if suffix == "weight" and len(full) == 2 else None, problems + ([problem] if problem else [])


def _unplanned(key: str, module: str, suffix: str, style, src: str) -> str | None:
    """Why tensor `key` has no place in the plan (a module or suffix the plan does not know), or None."""
    if style is None and not any(rx.match(module) for rx in _REPLICATED_RULES):
        return (
            f"Tensor '{key}' in '{src}' is not in the H3 tensor-parallel plan, so the pack cannot tell how to "
            "split it. This file may be a newer or modified H3; report it with what `python -m tp2.inspect FILE --tp-size 2` prints."
        )
    if suffix not in KNOWN_SUFFIXES:
        return (
            f"Tensor '{key}' in '{src}' has suffix '.{suffix}', which the plan does not know (known: "
            f"{', '.join(KNOWN_SUFFIXES)}). Use an unquantised or int8_tensorwise H3 checkpoint."
        )
    return None


def _check_block_shape(key, module, full, dims: H3Shape, src) -> list[str]:
    """Every block must have blocks.0's widths (detection reads only blocks.0), and adaln the timestep width."""
    rest = key.split(".", 2)[-1] if key.startswith("blocks.") else key.split(".", 3)[-1]
    want = dims.block_shapes().get(rest) if key.startswith(("blocks.", "token_refiner.blocks.")) else None
    if module.endswith("adaln_proj.linear") and key.endswith(".weight"):
        want = (full[0], dims.t_dim)
    if want is not None and tuple(full) != want:
        return [
            f"Tensor '{key}' in '{src}' has shape {list(full)} but the checkpoint's own dims (from blocks.0 and the "
            f"timestep embedding) require {list(want)}. The file is inconsistent, perhaps sliced by another tool; "
            "use the original full checkpoint."
        ]
    return []


def _tensor_shard(name, module, suffix, dtype, full, style, parts, tp_size) -> tuple[TensorShard | None, str | None]:
    whole = TensorShard(name, WHOLE, None, 1, full, full, dtype, style)
    if style == REPLICATE or suffix == "comfy_quant" or tp_size == 1:
        return whole, None
    if style in (COLWISE, COLWISE_PACKED):
        if suffix == "weight_scale" and math.prod(full) == 1:
            return whole, None  # a tensorwise scalar scale applies to every row
        dim = 0
    elif suffix == "weight":  # row-parallel: weights split along K
        dim = 1
    elif suffix == "bias":
        return TensorShard(name, RANK0, None, 1, full, full, dtype, style), None
    else:  # row-parallel scales are per output row, identical on every rank
        return whole, None
    if len(full) <= dim or full[dim] % (parts * tp_size):
        n = full[dim] if len(full) > dim else None
        what = f"{parts} packed parts x " if parts > 1 else ""
        return None, (
            f"Cannot split '{module}' ({suffix}, shape {list(full)}) dim {dim} of size {n} into "
            f"{what}tp_size={tp_size} slices: not divisible."
        )
    local = list(full)
    local[dim] //= tp_size
    return TensorShard(name, SPLIT, dim, parts, full, tuple(local), dtype, style), None


def _check_widths(heads: int, ffn: int, tp_size: int) -> list[str]:
    widths = (("blocks.*.attn.qkv_proj", "heads", heads), ("blocks.*.mlp.fc1", "ffn width", ffn))
    return [f"Cannot split '{layer}' {what} ({n}) across tp_size={tp_size}: not divisible." for layer, what, n in widths if n % tp_size]


def _check_quant(layout: CheckpointLayout, prefix: str, linears: dict[str, str], tp_size: int) -> list[str]:
    problems = []
    for module, conf in sorted(layout.quant.items()):
        if conf.get("format") not in SUPPORTED_QUANT_FORMATS:
            problems.append(
                f"Layer '{module}' uses quantisation format '{conf.get('format')}', which the TP plan does not support "
                f"(supported: {', '.join(SUPPORTED_QUANT_FORMATS)}, with or without ConvRot, and unquantised bf16/fp32). "
                "Use the int8 ConvRot or the bf16 H3 checkpoint."
            )
            continue
        layer, group = module[len(prefix) :], convrot_group(conf)
        if linears.get(layer) in ROW_PARALLEL and group:
            k = layout.shape(module + ".weight")[1]
            if k % tp_size == 0 and (k // tp_size) % group:
                problems.append(
                    f"Cannot split '{layer}' input dim K={k} across tp_size={tp_size}: the local K "
                    f"({k // tp_size}) is not a multiple of its ConvRot group ({group}), so a rank's slice would cut "
                    "a Hadamard block and the result would be wrong."
                )
    return problems
