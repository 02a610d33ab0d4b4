"""The MiniMax-H3 tensor-parallel plan: which tensor each rank holds, resolved from a checkpoint layout.

The widths come from the checkpoint (tp2.checkpoint H3Shape). Everything is validated here, before any weight is read or
any collective runs. Imports nothing from `comfy`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from dataclasses import dataclass

from .checkpoint import CheckpointLayout, H3Shape, convrot_group
from .split import Shares, cut, cut_named, is_even, per_rank, reduced, refusal, resolved, scaled

COLWISE = "colwise"  # Y = X A, A split by output rows; no collective
COLWISE_PACKED = "colwise_packed"  # the same, per fused part ([q|k|v], [gate|up]): each rank its slice of each
ROWWISE = "rowwise"  # Y = sum_r X_r A_r, A split by input columns; all-reduce(sum) after
ROWWISE_SPLIT_INPUT = "rowwise_split_input"  # rowwise whose input is replicated: each rank slices it first
REPLICATE = "replicate"

# How one tensor of a rank file relates to the full tensor.
SPLIT = "split"  # narrowed along `dim` (per packed part)
WHOLE = "whole"  # identical on every rank
RANK0 = "rank0"  # a row-parallel bias: rank 0 holds it, other ranks hold zeros, so the reduce adds it once

# Megatron-style plan of the H3 DiT, by module-name pattern ("*" is a block index) -> (style, packed parts).
# Attention and MLP are split column-then-row, so each block needs two all-reduces and nothing else.
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
    ADALN: (REPLICATE, 1),  # placeholder: a block's adaln is resolved by checkpoint form (ADALN_STYLE)
}
# the full form's adaln is ~260 M params per block at full size: halve it per rank; the curve form's is ~1 M
ADALN_STYLE = {"curve": REPLICATE, "full": ROWWISE_SPLIT_INPUT}

# Replicated on purpose: small layers every rank runs whole (projections, time embedder, final layer), per-channel
# norms and buffers. Listed so that an unknown tensor is an error instead of silently replicated.
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


def plan_fingerprint(tp_size: int, rows: list[list], shares: Shares) -> str:
    """The short hash a plan is known by (rank-cache file names, the ranks' handshake): its tensors, and uneven shares."""
    doc = {"tp_size": tp_size, "tensors": sorted(rows), **({} if is_even(shares) else {"shares": list(reduced(shares))})}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


_LINEAR_RULES = [(compile_pattern(p), style) for p, style in H3_TP_PLAN.items()]
_REPLICATED_RULES = [compile_pattern(p) for p in H3_REPLICATED]


@dataclass(frozen=True)
class TensorShard:
    """One tensor's place in the plan: how a rank's copy is cut from the full tensor."""

    name: str  # full key in the checkpoint (with prefix)
    kind: str  # SPLIT, WHOLE or RANK0
    dim: int | None  # SPLIT only
    parts: int  # packed parts along `dim` (1 when not packed)
    full_shape: tuple[int, ...]
    dtype: str
    layer_style: str  # style of the linear it belongs to, REPLICATE for non-linears
    bounds: tuple[int, ...] | None = None  # SPLIT only: rank r holds [bounds[r], bounds[r + 1]) of each part

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The shape rank `rank` holds (nvfp4 block scales: the stored shape, re-cut in memory)."""
        if self.kind != SPLIT:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = self.parts * (self.bounds[rank + 1] - self.bounds[rank])
        return tuple(shape)


@dataclass(frozen=True)
class Plan:
    """The resolved plan for one checkpoint at one tp_size (identical on every rank)."""

    tp_size: int
    shares: Shares
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
    head_bounds: tuple[int, ...]  # rank r holds heads [head_bounds[r], head_bounds[r + 1])
    ffn_bounds: tuple[int, ...]

    def local_heads(self, rank: int) -> int:
        return self.head_bounds[rank + 1] - self.head_bounds[rank]

    def local_ffn(self, rank: int) -> int:
        return self.ffn_bounds[rank + 1] - self.ffn_bounds[rank]

    def split(self) -> str:
        return cut_named(self.shares, [self.local_heads(r) for r in range(self.tp_size)])

    def fingerprint(self) -> str:
        rows = [[t.name, t.kind, t.dim, t.parts, list(t.full_shape), t.dtype] for t in self.tensors.values()]
        return plan_fingerprint(self.tp_size, rows, self.shares)

    def summary(self) -> str:
        styles = ", ".join(f"{n} {s}" for s, n in sorted(Counter(self.linears.values()).items()))
        ranks = range(self.tp_size)
        return (
            f"H3 tp_size={self.tp_size}, split {self.split()}: {self.num_layers} blocks + {self.refiner_layers} refiner, "
            f"heads {self.heads}->{per_rank([self.local_heads(r) for r in ranks])}, ffn {self.ffn}->{per_rank([self.local_ffn(r) for r in ranks])}, "
            f"adaln {self.adaln_form}-form; linears: {styles}; plan {self.fingerprint()}"
        )


def resolve_plan(layout: CheckpointLayout, tp_size: int, shares: Shares | None = None) -> Plan:
    """Resolve and validate the plan (shares None: the even split); raises PlanError naming what would work."""
    return resolved(_resolve, layout, tp_size, shares, range(1, 65))


def _resolve(layout: CheckpointLayout, tp_size: int, shares: Shares) -> tuple[Plan | None, list[str]]:
    dims = H3Shape.of(layout)
    pools, problems = _pools(layout, dims, tp_size, shares)
    linears: dict[str, str] = {}
    tensors: dict[str, TensorShard] = {}
    for name, (dtype, full) in layout.tensors.items():
        shard, linear_style, found = _place(layout.source, dims, pools, name, dtype, full)
        problems += found
        if shard:
            tensors[name] = shard
        if linear_style:
            linears[name[len(dims.prefix) :].rpartition(".")[0]] = linear_style
    problems += _check_quant(layout, dims.prefix, linears, tensors)
    if problems:
        return None, problems
    num_layers = 1 + max(int(k.split(".")[1]) for k in linears if k.startswith("blocks."))
    refiner_layers = 1 + max((int(k.split(".")[2]) for k in linears if k.startswith("token_refiner.blocks.")), default=-1)
    plan = Plan(
        tp_size, shares, dims.prefix, dims.adaln_form, dims.hidden, dims.heads, dims.head_dim, dims.ffn, num_layers, refiner_layers,
        linears, tensors, pools["attn"][1], pools["mlp"][1],
    )  # fmt: skip
    return plan, []


def _pools(layout: CheckpointLayout, dims: H3Shape, tp_size: int, shares: Shares) -> tuple[dict, list[str]]:
    """Each split width ("attn": heads, "mlp": FFN columns, "adaln": the full form's adaln input) as (total, bounds).
    Uneven shares cut in whole units: heads filling whole ConvRot groups of out_proj's input (pairs of 128-wide heads
    in groups of 256), FFN columns and adaln inputs in ConvRot groups (at least 16); even slices' groups are checked in _check_quant."""
    group = lambda layer: convrot_group(layout.quant.get(dims.prefix + layer)) or 1  # noqa: E731
    head_unit = math.lcm(dims.head_dim, group("blocks.0.attn.out_proj")) // dims.head_dim
    widths = {
        "attn": (dims.heads, head_unit, "heads", "blocks.*.attn.qkv_proj"),
        "mlp": (dims.ffn, math.lcm(16, group("blocks.0.mlp.fc2")), "ffn width", "blocks.*.mlp.fc1"),
        "adaln": (dims.t_dim, math.lcm(16, group("blocks.0.adaln_proj.linear")), "adaln input", ADALN),
    }
    pools, problems = {}, []
    for key, (total, unit, what, layer) in widths.items():
        pools[key] = (total, cut(total, unit, shares))
        if pools[key][1] is not None or key == "adaln" and dims.adaln_form == "curve":
            continue
        even_refusal = f"Cannot split '{layer}' {what} ({total}) across tp_size={tp_size}: not divisible."
        problems.append(even_refusal if is_even(shares) else refusal(shares, f"DiT's {what}", total, unit))
    return pools, problems


def _place(src, dims: H3Shape, pools, name, dtype, full) -> tuple[TensorShard | None, str | None, list[str]]:
    """Tensor `name`'s place in the plan, its linear's style when it is a linear's 2-D weight, and what is wrong."""
    prefix = dims.prefix
    if not name.startswith(prefix):
        return None, None, [f"Tensor '{name}' in '{src}' is outside the H3 model (prefix '{prefix}'). Use a diffusion-model-only H3 file."]
    key = name[len(prefix) :]
    if key in H3_BUFFERS:
        return TensorShard(name, WHOLE, None, 1, full, dtype, REPLICATE), None, []
    module, _, suffix = key.rpartition(".")
    style = next((style for rx, style in _LINEAR_RULES if rx.match(module)), None)
    if style and module.endswith("adaln_proj.linear"):  # a block's adaln (the final layer's is replicated)
        style = (ADALN_STYLE[dims.adaln_form], 1)
    if unplanned := _unplanned(key, module, suffix, style, src):
        return None, None, [unplanned]
    style, parts = style or (REPLICATE, 1)
    problems = _check_block_shape(key, module, full, dims, src)
    pool = pools["attn" if ".attn." in key else "mlp" if ".mlp." in key else "adaln"]
    shard, problem = _tensor_shard(name, module, suffix, dtype, full, style, parts, pool)
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


def _tensor_shard(name, module, suffix, dtype, full, style, parts, pool) -> tuple[TensorShard | None, str | None]:
    """`pool`: (total, bounds) of the width this layer splits; bounds None when it cannot be split (reported once)."""
    whole, bounds = TensorShard(name, WHOLE, None, 1, full, dtype, style), pool[1]
    if style == REPLICATE or suffix == "comfy_quant" or bounds is not None and len(bounds) == 2:
        return whole, None
    if style in (COLWISE, COLWISE_PACKED):
        if suffix == "weight_scale" and math.prod(full) == 1:
            return whole, None  # a tensorwise scalar scale applies to every row
        dim = 0
    elif suffix == "weight":  # row-parallel: weights split along K
        dim = 1
    elif suffix == "bias":
        return TensorShard(name, RANK0, None, 1, full, dtype, style), None
    else:  # row-parallel scales are per output row, identical on every rank
        return whole, None
    if bounds is None:
        return None, None  # the width's refusal says why
    return split_shard(name, dtype, full, style, pool, dim, parts)


def split_shard(name, dtype, full, style, pool, dim: int, parts: int = 1) -> tuple[TensorShard | None, str | None]:
    """`full` cut along `dim` (per packed part) at `pool`'s bounds (total, bounds), or why its size does not divide."""
    total, bounds = pool
    mine = scaled(bounds, total, full[dim] // parts) if len(full) > dim and full[dim] % parts == 0 else None
    if mine is None:
        what = f"{parts} packed parts x " if parts > 1 else ""
        return None, f"Cannot split '{name}' (shape {list(full)}) along dim {dim} into {what}{len(bounds) - 1} slices: not divisible."
    return TensorShard(name, SPLIT, dim, parts, full, dtype, style, mine), None


def _check_quant(layout: CheckpointLayout, prefix: str, linears: dict[str, str], tensors: dict[str, TensorShard]) -> list[str]:
    problems = []
    for module, conf in sorted(layout.quant.items()):
        if conf.get("format") not in SUPPORTED_QUANT_FORMATS:
            problems.append(
                f"Layer '{module}' uses quantisation format '{conf.get('format')}', which the TP plan does not support "
                f"(supported: {', '.join(SUPPORTED_QUANT_FORMATS)}, with or without ConvRot, and unquantised bf16/fp32). "
                "Use the int8 ConvRot or the bf16 H3 checkpoint."
            )
            continue
        ts = tensors.get(module + ".weight")
        if linears.get(module[len(prefix) :]) in (ROWWISE, ROWWISE_SPLIT_INPUT) and ts is not None and ts.kind == SPLIT:
            problems += convrot_problems(module[len(prefix) :], ts, convrot_group(conf))
    return problems


def convrot_problems(layer: str, ts: TensorShard, group: int | None) -> list[str]:
    """Why the K slices of a row-parallel weight cut its ConvRot group (none when the layer is not rotated)."""
    widths = [ts.local_shape(r)[1] for r in range(len(ts.bounds) - 1)]
    bad = next((w for w in widths if group and w % group), None)
    if bad is None:
        return []
    across = f"across tp_size={len(widths)}" if len(set(widths)) == 1 else f"into {'+'.join(map(str, widths))}"
    return [
        f"Cannot split '{layer}' input dim K={ts.full_shape[1]} {across}: the local K ({bad}) is not a multiple of its "
        f"ConvRot group ({group}), so a rank's slice would cut a Hadamard block and the result would be wrong."
    ]
