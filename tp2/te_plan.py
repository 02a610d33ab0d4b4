"""The tensor-parallel plan of H3's text encoder (Qwen3-VL-32B, truncated to 50 layers), resolved from a file's layout.

Megatron style, per decoder layer: q/k/v and gate/up are column-parallel (each rank its query heads, its KV heads and its
FFN columns: contiguous head ranges keep every query head with its KV head), o_proj and down_proj row-parallel (each rank
a K slice; one all-reduce each). The token embedding is vocabulary-parallel: each rank holds a contiguous 1/tp_size of
the rows, looks up the tokens that fall in it, and one all-reduce per encode sums the rows (each token's row comes from
exactly one rank: exact). Replicated: norms and per-head q/k norms (per-channel weights), and the vision tower (run only
for image inputs). Layers the built model does not have (past H3_TE_LAYERS, an lm_head) are not read at all.

Every quantisation layout is sliced with its scales: int8 tensorwise (with or without ConvRot) and fp8 (scalar scales:
whole on every rank), nvfp4 with AWQ (packed weight and block scales sliced along the split dim, pre_quant_scale along K
for row-parallel layers, see tp2/nvfp4.py), unquantised bf16/fp16/fp32. Imports nothing from `comfy`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .checkpoint import CheckpointLayout, convrot_group
from .errors import PlanError
from .nvfp4 import BLOCK
from .plan import COLWISE, REPLICATE, ROWWISE, SPLIT, WHOLE, TensorShard, compile_pattern, convrot_problems, plan_fingerprint, split_shard
from .split import Shares, cut, cut_named, is_even, per_rank, refusal, resolved, scaled

# ComfyUI's Qwen3VL_32BConfig builds 50 decoder layers: H3's conditioning is the hidden state after layer 50.
H3_TE_LAYERS = 50
# ComfyUI picks the H3 encoder by these two keys (comfy/sd.py detect_te_model, TEModel.QWEN3VL_32B).
DETECT_KEYS = ("visual.deepstack_merger_list.0.norm.weight", "model.layers.49.self_attn.q_proj.weight")
NVFP4_BLOCK_SCALE = "nvfp4_block_scale"  # a TensorShard kind: block scales in comfy-kitchen's swizzled layout
VOCAB_PARALLEL = "vocab_parallel"  # the token embedding: rows (tokens) split over the ranks
EMBEDDING = "model.embed_tokens"

TE_TP_PLAN = {  # layer -> (style, the width it splits: a pool of _pools)
    EMBEDDING: (VOCAB_PARALLEL, "vocab"),
    "model.layers.*.self_attn.q_proj": (COLWISE, "q"),
    "model.layers.*.self_attn.k_proj": (COLWISE, "kv"),
    "model.layers.*.self_attn.v_proj": (COLWISE, "kv"),
    "model.layers.*.self_attn.o_proj": (ROWWISE, "q"),
    "model.layers.*.mlp.gate_proj": (COLWISE, "ffn"),
    "model.layers.*.mlp.up_proj": (COLWISE, "ffn"),
    "model.layers.*.mlp.down_proj": (ROWWISE, "ffn"),
}
TE_REPLICATED = (
    "model.norm",
    "model.layers.*.input_layernorm",
    "model.layers.*.post_attention_layernorm",
    "model.layers.*.self_attn.q_norm",
    "model.layers.*.self_attn.k_norm",
)
TE_SKIPPED = ("model.lm_head.weight", "lm_head.weight")  # ComfyUI builds no lm_head for H3 (lm_head False)
SUPPORTED_TE_FORMATS = ("int8_tensorwise", "float8_e4m3fn", "float8_e5m2", "nvfp4")
SCALAR_SUFFIXES = ("weight_scale_2", "input_scale")


_SPLIT_RULES = [(compile_pattern(p), style_pool) for p, style_pool in TE_TP_PLAN.items()]
_REPLICATED = [compile_pattern(p) for p in TE_REPLICATED]


@dataclass(frozen=True)
class TEPlan:
    """The resolved plan of one encoder file at one tp_size (identical on every rank)."""

    tp_size: int
    shares: Shares
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    linears: dict[str, str]  # layer name -> COLWISE / ROWWISE / REPLICATE
    tensors: dict[str, TensorShard]  # every tensor this rank reads, by name (not those the built model lacks)
    bounds: dict[str, tuple[int, ...]]  # "q", "kv" (heads), "ffn" (columns), "vocab" (rows): rank r holds [b[r], b[r + 1])

    def local(self, pool: str, rank: int) -> int:
        return self.bounds[pool][rank + 1] - self.bounds[pool][rank]

    def local_config(self, rank: int) -> dict[str, int]:
        """ComfyUI's `qwen3vl_32b_model_config` override: the model built at rank `rank`'s width."""
        return {
            "vocab_size": self.local("vocab", rank),
            "hidden_size": self.hidden,
            "num_attention_heads": self.local("q", rank),
            "num_key_value_heads": self.local("kv", rank),
            "intermediate_size": self.local("ffn", rank),
        }

    def fingerprint(self) -> str:
        rows = [[t.name, t.kind, t.dim, list(t.full_shape), t.dtype] for t in self.tensors.values()]
        return plan_fingerprint(self.tp_size, rows, self.shares)

    def split(self) -> str:
        return cut_named(self.shares, [self.local("kv", r) for r in range(self.tp_size)])

    def summary(self) -> str:
        w = {p: per_rank([self.local(p, r) for r in range(self.tp_size)]) for p in self.bounds}
        return (
            f"H3 text encoder tp_size={self.tp_size}, split {self.split()}: {H3_TE_LAYERS} layers, vocabulary "
            f"{self.vocab}->{w['vocab']}, heads {self.heads}->{w['q']}, KV heads {self.kv_heads}->{w['kv']}, "
            f"ffn {self.ffn}->{w['ffn']}; plan {self.fingerprint()}"
        )


def is_h3_text_encoder(layout: CheckpointLayout) -> bool:
    """Whether ComfyUI would build this file as H3's Qwen3-VL-32B encoder (its own detection keys)."""
    return all(k in layout.tensors for k in DETECT_KEYS)


def resolve_te_plan(layout: CheckpointLayout, tp_size: int, shares: Shares | None = None) -> TEPlan:
    """Resolve and validate (shares None: the even split); raises PlanError naming the first problem and what would work."""
    if not is_h3_text_encoder(layout):
        raise PlanError(
            f"'{layout.source}' is not MiniMax-H3's text encoder (Qwen3-VL-32B truncated to 50 layers): it lacks "
            f"{', '.join(k for k in DETECT_KEYS if k not in layout.tensors)}. Pick the H3 encoder file "
            "(e.g. qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors) in the CLIP loader, type 'minimax'."
        )
    return resolved(_resolve, layout, tp_size, shares, (1, 2, 4, 8))


def _dims(layout: CheckpointLayout) -> tuple[int, int, int, int, int]:
    """(hidden, head_dim, heads, kv_heads, ffn) from norms and the first layer (quantised shapes are logical rows)."""
    rows = lambda k: layout.tensors["model.layers.0." + k + ".weight"][1][0]  # noqa: E731 - output rows: unpacked in every format
    head_dim = rows("self_attn.q_norm")
    hidden, heads, kv_heads = rows("input_layernorm"), rows("self_attn.q_proj") // head_dim, rows("self_attn.k_proj") // head_dim
    return hidden, head_dim, heads, kv_heads, rows("mlp.gate_proj")


def _resolve(layout: CheckpointLayout, tp_size: int, shares: Shares) -> tuple[TEPlan | None, list[str]]:
    hidden, head_dim, heads, kv_heads, ffn = _dims(layout)
    vocab = layout.tensors.get(EMBEDDING + ".weight", (None, (0,)))[1][0]
    pools, problems = _pools(layout, (head_dim, heads, kv_heads, ffn, vocab), tp_size, shares)
    if not vocab:
        problems.insert(0, f"'{layout.source}' has no '{EMBEDDING}.weight': the encoder file is incomplete. Re-download it.")
    linears: dict[str, str] = {}
    tensors: dict[str, TensorShard] = {}
    for name, (dtype, full) in sorted(layout.tensors.items()):
        module, _, suffix = name.rpartition(".")
        layer = re.match(r"^model\.layers\.(\d+)\.", name)
        if name in TE_SKIPPED or layer and int(layer.group(1)) >= H3_TE_LAYERS:
            continue
        style, pool = _style(module)
        if style is None:
            problems.append(
                f"Tensor '{name}' in '{layout.source}' is not in the text encoder's tensor-parallel plan, so the pack "
                "cannot tell how to split it. This file may be a modified encoder; report it with this message."
            )
            continue
        if suffix == "weight" and len(full) == 2 and module != EMBEDDING:
            linears[module] = style
        shard, problem = _te_tensor_shard(name, suffix, dtype, full, style, layout.quant.get(module), pools[pool])
        if problem:
            problems.append(problem)
        elif shard is not None:
            tensors[name] = shard
    problems += _check_quant(layout, linears, tensors, shares)
    if problems:
        return None, problems
    bounds = {k: tuple(b // (head_dim if k in ("q", "kv") else 1) for b in v[1]) for k, v in pools.items() if k}
    return TEPlan(tp_size, shares, hidden, vocab, heads, kv_heads, head_dim, ffn, linears, tensors, bounds), []


def _pools(layout: CheckpointLayout, widths, tp_size: int, shares: Shares) -> tuple[dict, list[str]]:
    """Each split width as (total, bounds) in elements of the layers' logical dims: "q" (query rows, following the
    KV heads: each KV head keeps its query heads), "kv" (KV rows), "ffn" (columns; whole 16-column nvfp4 blocks, and
    ConvRot groups), "vocab" (embedding rows); None: replicated."""
    head_dim, heads, kv_heads, ffn, vocab = widths
    ffn_unit = math.lcm(BLOCK, convrot_group(layout.quant.get("model.layers.0.mlp.down_proj")) or 1)
    kv = cut(kv_heads, 1, shares) if kv_heads else None
    pools = {
        "q": (heads * head_dim, scaled(kv, kv_heads, heads * head_dim)),
        "kv": (kv_heads * head_dim, scaled(kv, kv_heads, kv_heads * head_dim)),
        "ffn": (ffn, cut(ffn, ffn_unit, shares)),
        "vocab": (vocab, cut(vocab, 1, shares) if vocab else None),
        None: None,
    }
    problems = []
    for what, n, unit, key in (
        ("query heads", heads, None, "q"),  # uneven: they follow the KV heads, refused with them
        ("KV heads", kv_heads, 1, "kv"),
        ("FFN width", ffn, ffn_unit, "ffn"),
        ("vocabulary", vocab, 1, "vocab"),
    ):
        if is_even(shares) and n % tp_size:
            problems.append(f"Cannot split the text encoder's {what} ({n}) across tp_size={tp_size}: not divisible.")
        elif not is_even(shares) and unit and n and pools[key][1] is None:
            problems.append(refusal(shares, f"text encoder's {what}", n, unit))
    return pools, problems


def _style(module: str) -> tuple[str | None, str | None]:
    """A module's style (None: not in the plan) and its pool (None: replicated)."""
    if module.startswith("visual."):
        return REPLICATE, None
    for rx, style_pool in _SPLIT_RULES:
        if rx.match(module):
            return style_pool
    return REPLICATE if any(rx.match(module) for rx in _REPLICATED) else None, None


def _te_tensor_shard(name, suffix, dtype, full, style, quant, pool) -> tuple[TensorShard | None, str | None]:
    whole = TensorShard(name, WHOLE, None, 1, full, dtype, style)
    if style == REPLICATE or suffix in ("comfy_quant", *SCALAR_SUFFIXES) or pool[1] is not None and len(pool[1]) == 2:
        return whole, None
    if pool[1] is None:
        return None, None  # the width's refusal says why
    if suffix == "weight_scale" and (quant or {}).get("format") != "nvfp4":  # int8 / fp8: one scalar, or one scale per output row
        return split_shard(name, dtype, full, style, pool, 0) if style == COLWISE and math.prod(full) > 1 else (whole, None)
    if suffix == "pre_quant_scale":  # AWQ smoothing, one factor per input channel
        return split_shard(name, dtype, full, style, pool, 0) if style == ROWWISE else (whole, None)
    if style == VOCAB_PARALLEL:
        return split_shard(name, dtype, full, style, pool, 0)
    dim = 0 if style == COLWISE else 1
    if suffix == "weight_scale":  # nvfp4 block scales, swizzled: read whole, re-cut in memory (tp2/nvfp4.py) at the
        # logical bounds; the local shape depends on the layer's padded rows, so the shard records the stored shape
        return TensorShard(name, NVFP4_BLOCK_SCALE, dim, 1, full, dtype, style, pool[1]), None
    if suffix in ("weight", "bias") and not (suffix == "bias" and style == ROWWISE):
        return split_shard(name, dtype, full, style, pool, dim if suffix == "weight" else 0)
    return None, f"Tensor '{name}' ({suffix}) has no place in the text encoder's plan for a {style} layer. Report the file's origin."


def _check_quant(layout: CheckpointLayout, linears: dict[str, str], tensors: dict[str, TensorShard], shares: Shares) -> list[str]:
    problems = []
    for module, conf in sorted(layout.quant.items()):
        fmt, style = conf.get("format"), linears.get(module)
        if fmt not in SUPPORTED_TE_FORMATS:
            problems.append(
                f"Text encoder layer '{module}' uses quantisation format '{fmt}', which the TP plan cannot slice "
                f"(supported: {', '.join(SUPPORTED_TE_FORMATS)}, and unquantised bf16/fp16/fp32). Use the nvfp4 AWQ, "
                "int8, fp8 or bf16 H3 encoder file, or run with --tp-size 1."
            )
            continue
        weight = tensors.get(module + ".weight")
        if style not in (COLWISE, ROWWISE) or weight is None or weight.kind != SPLIT:
            continue
        if fmt == "nvfp4":
            bounds = tensors[module + ".weight_scale"].bounds
            bad = next((b - a for a, b in zip(bounds, bounds[1:]) if (b - a) % BLOCK), None)
            if bad is not None:
                why = (
                    f"the local K ({bad}) is not a multiple of {BLOCK}, so a rank's slice would cut a {BLOCK}-column nvfp4 block."
                    if weight.dim
                    else f"a rank's {bad} rows would need their 16-row padding redone; the pack reads nvfp4 slices as stored."
                )
                problems.append(f"Cannot split nvfp4 layer '{module}' across tp_size={len(shares)}: {why}")
        if style == ROWWISE:
            problems += convrot_problems(module, weight, convrot_group(conf))
    return problems
