"""The text encoder's TP plan (tp2/te_plan.py) on layouts with H3's key names: which tensor each rank reads, and every
refusal, before a byte of weights is read. Layouts come from scripts/make_tiny_qwen3vl.py's specs (no files)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tp2.checkpoint import CheckpointLayout
from tp2.errors import PlanError
from tp2.plan import COLWISE, REPLICATE, ROWWISE, SPLIT, WHOLE
from tp2.safetensors_io import DTYPE_CODES
from tp2.te_plan import H3_TE_LAYERS, NVFP4_BLOCK_SCALE, resolve_te_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("make_tiny_qwen3vl", os.path.join(ROOT, "scripts", "make_tiny_qwen3vl.py"))
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def layout(fmt: str = "bf16", dims: dict | None = None, extra: dict | None = None, drop=()) -> CheckpointLayout:
    d = dims or gen.TINY
    tensors, quant = {}, {}
    for name, shape, _kind in gen.tensor_specs(d):
        layer = name[: -len(".weight")]
        if fmt != "bf16" and name.endswith(".weight") and layer.endswith(gen.QUANTISED):
            for suffix, (dtype, s) in gen.part_specs(fmt, shape).items():
                tensors[f"{layer}.{suffix}"] = (DTYPE_CODES[dtype], tuple(s))
            quant[layer] = {"format": gen.FORMATS[fmt]}
        else:
            tensors[name] = ("BF16", tuple(shape))
    tensors.update(extra or {})
    for k in drop:
        tensors.pop(k)
    return CheckpointLayout(tensors, {}, quant, "te.safetensors")


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8", "nvfp4"])
@pytest.mark.parametrize("tp", [2, 4])
def test_roles_and_slices(fmt, tp):
    plan = resolve_te_plan(layout(fmt), tp)
    p = "model.layers.7."
    assert plan.linears[p + "self_attn.q_proj"] == plan.linears[p + "mlp.up_proj"] == COLWISE
    assert plan.linears[p + "self_attn.o_proj"] == plan.linears[p + "mlp.down_proj"] == ROWWISE
    assert plan.linears["visual.blocks.0.attn.qkv"] == REPLICATE
    d = gen.TINY
    q, o = plan.tensors[p + "self_attn.q_proj.weight"], plan.tensors[p + "self_attn.o_proj.weight"]
    assert (q.kind, q.dim, o.kind, o.dim) == (SPLIT, 0, SPLIT, 1)
    assert q.local_shape(0)[0] == d["heads"] * d["head_dim"] // tp
    emb = plan.tensors["model.embed_tokens.weight"]  # vocabulary-parallel: rows split
    assert (emb.kind, emb.dim, emb.local_shape(0)) == (SPLIT, 0, (gen.VOCAB // tp, d["hidden"]))
    assert plan.tensors["model.layers.0.input_layernorm.weight"].kind == WHOLE
    assert plan.local_config(tp - 1) == {
        "vocab_size": gen.VOCAB // tp, "hidden_size": d["hidden"], "num_attention_heads": d["heads"] // tp,
        "num_key_value_heads": d["kv_heads"] // tp, "intermediate_size": d["ffn"] // tp,
    }  # fmt: skip
    if fmt == "int8":  # one scale per output row: split with the rows of a column-parallel layer, whole for row-parallel
        assert plan.tensors[p + "self_attn.k_proj.weight_scale"].kind == SPLIT
        assert plan.tensors[p + "mlp.down_proj.weight_scale"].kind == WHOLE
    if fmt == "nvfp4":
        assert plan.tensors[p + "mlp.down_proj.weight_scale"].kind == NVFP4_BLOCK_SCALE
        assert plan.tensors[p + "mlp.down_proj.pre_quant_scale"].kind == SPLIT  # AWQ smoothing along K
        assert plan.tensors[p + "mlp.up_proj.pre_quant_scale"].kind == WHOLE
        assert plan.tensors[p + "mlp.up_proj.weight_scale_2"].kind == WHOLE


def test_tp1_reads_everything_whole():
    plan = resolve_te_plan(layout("nvfp4"), 1)
    assert {t.kind for t in plan.tensors.values()} == {WHOLE}


def test_layers_and_lm_head_comfyui_does_not_build_are_never_read():
    extra = {"lm_head.weight": ("BF16", (gen.VOCAB, 128)), f"model.layers.{H3_TE_LAYERS}.input_layernorm.weight": ("BF16", (128,))}
    plan = resolve_te_plan(layout(extra=extra), 2)
    assert not set(extra) & set(plan.tensors)


@pytest.mark.parametrize(
    "dims, tp, message",
    [
        (dict(gen.TINY, heads=12, kv_heads=4), 8, "query heads (12) across tp_size=8"),
        (dict(gen.TINY, kv_heads=2, heads=8), 4, "KV heads (2) across tp_size=4"),
        (dict(gen.TINY, ffn=100), 8, "FFN width (100) across tp_size=8"),
    ],
)
def test_indivisible_widths_are_refused_with_what_would_work(dims, tp, message):
    with pytest.raises(PlanError, match=r"Use tp_size") as e:
        resolve_te_plan(layout(dims=dims), tp)
    assert message in str(e.value)


def test_nvfp4_slice_that_cuts_a_block_is_refused():
    dims = dict(gen.TINY, ffn=96)  # down_proj K = 96: a quarter is 24 columns, half a 16-block too many
    with pytest.raises(PlanError, match=r"nvfp4 layer 'model\.layers\.0\.mlp\.down_proj' across tp_size=4"):
        resolve_te_plan(layout("nvfp4", dims=dims), 4)
    resolve_te_plan(layout("nvfp4", dims=dims), 2)  # 48 columns: three whole blocks


def test_unknown_quantisation_format_is_refused():
    lay = layout("int8")
    quant = dict(lay.quant, **{"model.layers.3.mlp.up_proj": {"format": "mxfp8"}})
    with pytest.raises(PlanError, match=r"'model\.layers\.3\.mlp\.up_proj' uses quantisation format 'mxfp8'"):
        resolve_te_plan(CheckpointLayout(lay.tensors, {}, quant, lay.source), 2)


def test_unknown_tensor_is_refused_not_replicated():
    with pytest.raises(PlanError, match=r"'model\.layers\.0\.self_attn\.sinks' .* not in the text encoder's tensor-parallel plan"):
        resolve_te_plan(layout(extra={"model.layers.0.self_attn.sinks": ("BF16", (16,))}), 2)


def test_an_encoder_without_its_embedding_is_refused():
    with pytest.raises(PlanError, match=r"has no 'model\.embed_tokens\.weight'"):
        resolve_te_plan(layout(drop=["model.embed_tokens.weight"]), 2)


def test_a_file_that_is_not_h3s_encoder_is_refused():
    with pytest.raises(PlanError, match=r"is not MiniMax-H3's text encoder .* visual\.deepstack_merger_list\.0\.norm\.weight"):
        resolve_te_plan(layout(drop=["visual.deepstack_merger_list.0.norm.weight"]), 2)


def test_plan_fingerprint_depends_on_tp_size_and_layout():
    a, b = resolve_te_plan(layout(), 2), resolve_te_plan(layout(), 4)
    assert a.fingerprint() != b.fingerprint() and a.fingerprint() == resolve_te_plan(layout(), 2).fingerprint()
    assert a.fingerprint() != resolve_te_plan(layout("int8"), 2).fingerprint()


def test_generator_layout_is_what_comfyui_builds():
    """The generator's names and shapes at the fixture's dims are exactly the state dict of ComfyUI's own class."""
    from conftest import COMFYUI_DIR as comfy_dir

    if not os.path.isfile(os.path.join(comfy_dir, "comfy", "text_encoders", "minimax.py")):
        pytest.skip(f"no ComfyUI with H3 at {comfy_dir}")
    import subprocess
    import sys

    code = (
        "import os, sys, json, torch; sys.path.insert(0, os.getcwd()); import comfy.cli_args as a; a.args.cpu = True;"
        f"os.environ['H3_TEST_TINY_TE'] = '1'; sys.path.insert(0, {os.path.join(ROOT, 'tests', 'comfy', 'fixtures')!r});"
        "import h3_tiny_text_encoder, comfy.ops; from comfy.text_encoders.minimax import MiniMaxQwen3VL;"
        "m = MiniMaxQwen3VL({}, torch.bfloat16, 'meta', comfy.ops.manual_cast);"
        "print(json.dumps({k: list(v.shape) for k, v in m.state_dict().items()}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=comfy_dir, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    built = json.loads(out.stdout.strip().splitlines()[-1])
    ours = {name: list(shape) for name, shape, _ in gen.tensor_specs(gen.TINY)}
    assert ours == built
    assert torch.Size(ours["model.layers.0.self_attn.k_proj.weight"])[0] == gen.TINY["kv_heads"] * gen.TINY["head_dim"]


def test_uneven_shares_follow_kv_heads_and_nvfp4_blocks():
    plan = resolve_te_plan(layout("nvfp4"), 2, (5, 3))
    d = gen.TINY
    assert plan.local_config(0)["num_key_value_heads"] == 5 and plan.local_config(1)["num_key_value_heads"] == 3
    assert plan.local_config(0)["num_attention_heads"] == 5 * d["heads"] // d["kv_heads"]  # each KV head keeps its queries
    assert [plan.local("ffn", r) % 16 for r in (0, 1)] == [0, 0] and plan.local("ffn", 0) + plan.local("ffn", 1) == d["ffn"]
    scale = plan.tensors["model.layers.3.mlp.down_proj.weight_scale"]
    assert scale.bounds == plan.bounds["ffn"]  # block scales cut at the logical K bounds
    with pytest.raises(PlanError, match=r"text encoder's KV heads \(8 = 8 units of 1\)\. The nearest split that works is 7:1"):
        resolve_te_plan(layout("nvfp4"), 2, (20, 1))
