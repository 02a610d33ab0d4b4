"""Plan resolution against the real H3 layouts (names/shapes/dtypes, no weights) and every refusal, messages pinned."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tp2.checkpoint import CheckpointLayout
from tp2.errors import PlanError
from tp2.plan import (
    COLWISE_PACKED,
    RANK0,
    REPLICATE,
    ROWWISE,
    ROWWISE_SPLIT_INPUT,
    SPLIT,
    WHOLE,
    resolve_plan,
)

BIG = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def _edit(layout: CheckpointLayout, **changes) -> CheckpointLayout:
    return dataclasses.replace(layout, **changes)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_real_int8_layout_accepted(h3_int8_layout, tp_size):
    plan = resolve_plan(h3_int8_layout, tp_size)
    assert (plan.hidden, plan.heads, plan.head_dim, plan.ffn) == (5376, 56, 128, 14336)
    assert (plan.num_layers, plan.refiner_layers, plan.adaln_form) == (50, 2, "curve")
    assert plan.local_heads(0) == 56 // tp_size and plan.local_ffn(tp_size - 1) == 14336 // tp_size
    assert set(plan.tensors) == set(h3_int8_layout.tensors)


def test_tp2_local_shapes_match_the_megatron_table(h3_int8_layout):
    plan = resolve_plan(h3_int8_layout, 2)
    want = {
        "attn.qkv_proj": (COLWISE_PACKED, (10752, 5376)),
        "attn.out_proj": (ROWWISE, (5376, 3584)),
        "mlp.fc1": (COLWISE_PACKED, (14336, 5376)),
        "mlp.fc2": (ROWWISE, (5376, 7168)),
    }
    for prefix in [f"blocks.{i}." for i in range(50)] + ["token_refiner.blocks.0.", "token_refiner.blocks.1."]:
        for layer, (style, local) in want.items():
            ts = plan.tensors[prefix + layer + ".weight"]
            assert (ts.layer_style, ts.local_shape(0), ts.dtype) == (style, local, "I8"), prefix + layer


def test_every_linear_is_covered_exactly_once(h3_int8_layout, h3_full_layout):
    for layout in (h3_int8_layout, h3_full_layout):
        plan = resolve_plan(layout, 2)
        weights2d = {n[: -len(".weight")] for n, (_, s) in layout.tensors.items() if n.endswith(".weight") and len(s) == 2}
        assert set(plan.linears) == weights2d
        sharded = sorted(k for k, s in plan.linears.items() if s != REPLICATE)
        expected = sorted(
            f"{p}.{b}" for p in [f"blocks.{i}" for i in range(50)] + ["token_refiner.blocks.0", "token_refiner.blocks.1"] for b in BIG
        )
        if layout is h3_full_layout:
            expected = sorted(expected + [f"blocks.{i}.adaln_proj.linear" for i in range(50)])
        assert sharded == expected


def test_suffix_rules_for_int8(h3_int8_layout):
    plan = resolve_plan(h3_int8_layout, 2)
    col_scale = plan.tensors["blocks.7.attn.qkv_proj.weight_scale"]
    assert (col_scale.kind, col_scale.dim, col_scale.parts, col_scale.local_shape(0)) == (SPLIT, 0, 3, (10752, 1))
    row_scale = plan.tensors["blocks.7.mlp.fc2.weight_scale"]
    assert (row_scale.kind, row_scale.local_shape(0)) == (WHOLE, (5376, 1))
    for layer in BIG:
        assert plan.tensors[f"blocks.3.{layer}.comfy_quant"].kind == WHOLE
    assert plan.tensors["blocks.3.adaln_proj.linear.weight"].kind == WHOLE  # curve form: ~1 M params, replicated
    assert plan.tensors["adaln_t_table"].kind == WHOLE


def test_full_form_adaln_is_split_along_its_input(h3_full_layout):
    plan = resolve_plan(h3_full_layout, 2)
    assert plan.adaln_form == "full"
    w = plan.tensors["blocks.12.adaln_proj.linear.weight"]
    assert (w.layer_style, w.kind, w.dim, w.full_shape, w.local_shape(0)) == (ROWWISE_SPLIT_INPUT, SPLIT, 1, (96768, 2688), (96768, 1344))
    b = plan.tensors["blocks.12.adaln_proj.linear.bias"]
    assert (b.kind, b.local_shape(0)) == (RANK0, (96768,))
    # the final layer's adaln (2h rows) stays whole
    assert plan.tensors["final_layer.adaln_proj.linear.weight"].kind == WHOLE
    per_rank = sum(_bytes(t.local_shape(0), t.dtype) for t in plan.tensors.values())
    full = sum(_bytes(t.full_shape, t.dtype) for t in plan.tensors.values())
    assert per_rank / full < 0.52, f"per-rank share {per_rank / full:.3f}: adaln must halve too"


def _bytes(shape, dtype):
    n = {"BF16": 2, "F16": 2, "F32": 4, "I8": 1, "U8": 1}[dtype]
    for s in shape:
        n *= s
    return n


def test_tp3_refused_with_heads_message(h3_int8_layout):
    msg = re.escape("Cannot split 'blocks.*.attn.qkv_proj' heads (56) across tp_size=3: not divisible. Use tp_size 1, 2, 4, 7, 14 or 28.")
    with pytest.raises(PlanError, match=msg):
        resolve_plan(h3_int8_layout, 3)


def test_tp8_refused_by_convrot_group(h3_int8_layout):
    msg = (
        r"Cannot split 'blocks\.0\.attn\.out_proj' input dim K=7168 across tp_size=8: the local K \(896\) is not a "
        r"multiple of its ConvRot group \(256\).*Use tp_size 1, 2, 4, 7, 14 or 28\."
    )
    with pytest.raises(PlanError, match=msg):
        resolve_plan(h3_int8_layout, 8)


def test_tp8_allowed_without_convrot(h3_full_layout):
    assert resolve_plan(h3_full_layout, 8).local_heads(7) == 7


def test_bad_tp_size_value(h3_int8_layout):
    with pytest.raises(PlanError, match=r"tp_size must be a positive integer, got 0"):
        resolve_plan(h3_int8_layout, 0)


def test_not_h3_refused():
    layout = CheckpointLayout({"model.diffusion_model.input_blocks.0.0.weight": ("F16", (320, 4, 3, 3))}, source="sdxl.safetensors")
    with pytest.raises(PlanError, match=r"'sdxl\.safetensors' is not a MiniMax-H3 diffusion model: it has no 'video_patch_proj\.weight'"):
        resolve_plan(layout, 2)


def test_incomplete_h3_refused(h3_int8_layout):
    tensors = {k: v for k, v in h3_int8_layout.tensors.items() if not k.startswith("blocks.0.mlp.fc1")}
    with pytest.raises(PlanError, match=r"looks like MiniMax-H3 but lacks blocks\.0\.mlp\.fc1\.weight"):
        resolve_plan(_edit(h3_int8_layout, tensors=tensors), 2)


def test_already_sliced_refused_by_metadata(h3_int8_layout):
    layout = _edit(h3_int8_layout, metadata={"tp2.tp_rank": "1", "tp2.tp_size": "2"})
    with pytest.raises(PlanError, match=r"is already a tensor-parallel shard \(rank 1 of 2\); it cannot be sliced again"):
        resolve_plan(layout, 2)


def test_foreign_sliced_block_refused_by_shapes(h3_int8_layout):
    tensors = dict(h3_int8_layout.tensors)
    tensors["blocks.9.attn.out_proj.weight"] = ("I8", (5376, 3584))  # half of K, sliced by another tool
    msg = r"Tensor 'blocks\.9\.attn\.out_proj\.weight' .* has shape \[5376, 3584\] but the checkpoint's own dims .* require \[5376, 7168\]"
    with pytest.raises(PlanError, match=msg):
        resolve_plan(_edit(h3_int8_layout, tensors=tensors), 2)


def test_unknown_quant_format_refused(h3_int8_layout):
    quant = dict(h3_int8_layout.quant)
    quant["blocks.4.mlp.fc1"] = {"format": "float8_e4m3fn"}
    with pytest.raises(
        PlanError, match=r"Layer 'blocks\.4\.mlp\.fc1' uses quantisation format 'float8_e4m3fn', which the TP plan does not support"
    ):
        resolve_plan(_edit(h3_int8_layout, quant=quant), 2)


def test_unknown_suffix_refused(h3_int8_layout):
    tensors = dict(h3_int8_layout.tensors)
    tensors["blocks.4.mlp.fc1.input_scale"] = ("F32", (1,))
    with pytest.raises(
        PlanError, match=r"Tensor 'blocks\.4\.mlp\.fc1\.input_scale' .* has suffix '\.input_scale', which the plan does not know"
    ):
        resolve_plan(_edit(h3_int8_layout, tensors=tensors), 2)


def test_unknown_tensor_refused(h3_int8_layout):
    tensors = dict(h3_int8_layout.tensors)
    tensors["blocks.4.attn.gate_proj.weight"] = ("BF16", (5376, 5376))
    with pytest.raises(PlanError, match=r"Tensor 'blocks\.4\.attn\.gate_proj\.weight' .* is not in the H3 tensor-parallel plan"):
        resolve_plan(_edit(h3_int8_layout, tensors=tensors), 2)


def test_prefixed_checkpoint_resolves(h3_int8_layout):
    pre = "model.diffusion_model."
    layout = _edit(
        h3_int8_layout,
        tensors={pre + k: v for k, v in h3_int8_layout.tensors.items()},
        quant={pre + k: v for k, v in h3_int8_layout.quant.items()},
    )
    plan = resolve_plan(layout, 2)
    assert plan.prefix == pre
    assert plan.tensors[pre + "blocks.0.mlp.fc2.weight"].local_shape(0) == (5376, 7168)
    assert plan.fingerprint() != resolve_plan(h3_int8_layout, 2).fingerprint()


def test_fingerprint_depends_on_tp_size_and_shapes(h3_int8_layout, h3_full_layout):
    fps = {resolve_plan(h3_int8_layout, n).fingerprint() for n in (1, 2, 4)} | {resolve_plan(h3_full_layout, 2).fingerprint()}
    assert len(fps) == 4
    assert resolve_plan(h3_int8_layout, 2).fingerprint() == resolve_plan(h3_int8_layout, 2).fingerprint()


def test_tiny_file_plan_matches_layout_json(tiny_int8):
    layout = CheckpointLayout.from_file(tiny_int8)
    assert layout.quant["blocks.0.mlp.fc2"] == {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
    plan = resolve_plan(layout, 2)
    assert plan.tensors["blocks.1.mlp.fc2.weight"].local_shape(0) == (256, 256)
    with pytest.raises(PlanError, match=r"Use tp_size 1 or 2\.$"):  # out_proj K=512: tp 4 would leave 128 < one ConvRot group
        resolve_plan(layout, 4)


def test_a_pdd_head_bank_final_layer_stays_whole_on_every_rank(h3_int8_layout):
    """The newest upstream H3 FinalLayer holds a bank of n output heads (video_out/audio_out with n x the rows, picked
    by the sampler's sigma): replicated layers are taken whole, so the bank reaches every rank unchanged."""
    tensors = dict(h3_int8_layout.tensors)
    for head in ("video_out", "audio_out"):
        for suffix in ("weight", "bias"):
            name = f"final_layer.{head}.{suffix}"
            dtype, shape = tensors[name]
            tensors[name] = (dtype, (4 * shape[0],) + tuple(shape[1:]))
    plan = resolve_plan(_edit(h3_int8_layout, tensors=tensors), 2)
    for head in ("video_out", "audio_out"):
        shard = plan.tensors[f"final_layer.{head}.weight"]
        assert plan.linears[f"final_layer.{head}"] == REPLICATE and shard.kind == WHOLE
        assert shard.local_shape(0) == shard.full_shape == tensors[f"final_layer.{head}.weight"][1]


def test_uneven_shares_cut_whole_convrot_pairs_and_groups(h3_int8_layout):
    plan = resolve_plan(h3_int8_layout, 2, (3, 2))
    heads, ffn = [plan.local_heads(r) for r in (0, 1)], [plan.local_ffn(r) for r in (0, 1)]
    assert heads == [34, 22] and ffn == [8704, 5632]  # 28 pairs as 17 + 11, 56 groups of 256 as 34 + 22
    qkv = plan.tensors["blocks.4.attn.qkv_proj.weight"]
    assert qkv.local_shape(0) == (3 * 34 * 128, 5376) and qkv.bounds == (0, 34 * 128, 56 * 128)
    assert plan.tensors["blocks.4.attn.out_proj.weight"].local_shape(1) == (5376, 22 * 128)
    assert plan.tensors["blocks.4.mlp.fc2.weight"].local_shape(1) == (5376, 5632)
    assert "heads 56->34+22, ffn 14336->8704+5632" in plan.summary()


def test_shares_enter_the_fingerprint_only_when_uneven(h3_int8_layout):
    even = resolve_plan(h3_int8_layout, 2).fingerprint()
    assert resolve_plan(h3_int8_layout, 2, (1, 1)).fingerprint() == resolve_plan(h3_int8_layout, 2, (2, 2)).fingerprint() == even
    assert len({even, resolve_plan(h3_int8_layout, 2, (3, 2)).fingerprint(), resolve_plan(h3_int8_layout, 2, (3, 1)).fingerprint()}) == 3


def test_a_split_that_leaves_a_rank_no_pair_is_refused_with_the_nearest_that_works(h3_int8_layout):
    with pytest.raises(
        PlanError,
        match=r"The split 60:1 leaves a rank no whole unit of the DiT's heads \(56 = 28 units of 2\)\. The nearest split that works is 27:1\.",
    ):
        resolve_plan(h3_int8_layout, 2, (60, 1))
    resolve_plan(h3_int8_layout, 2, (27, 1))  # the one it names works
    with pytest.raises(PlanError, match=r"names 3 shares for tp_size=2"):
        resolve_plan(h3_int8_layout, 2, (1, 1, 1))


def test_uneven_shares_at_three_ranks_split_what_even_cannot(h3_int8_layout):
    with pytest.raises(PlanError, match=r"across tp_size=3"):
        resolve_plan(h3_int8_layout, 3)
    plan = resolve_plan(h3_int8_layout, 3, (2, 1, 1))
    assert [plan.local_heads(r) for r in range(3)] == [28, 14, 14]
