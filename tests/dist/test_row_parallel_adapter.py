"""The row-parallel linear ComfyUI runs (nodes/parallel.py rowwise_call: a real ComfyUI Linear, its weight cast by
ComfyUI) against the core's row_parallel (tp2/layers.py) on the plain weight, on real gloo groups: the same bits for the all-reduce
and for a reduce-scatter to a RowLayout, whose rows are this rank's rows of the all-reduce, and partial
sums that add up to it. Both run tp2.layers.row_parallel, the one implementation; this pins that ComfyUI's path is
that one. The text encoder's (full_precision_rowwise_call, an nvfp4 AWQ layer as ComfyUI builds it) likewise, and
the same bits as ComfyUI's own forward plus an all-reduce in the fp32 the encoder runs in. Needs ComfyUI."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from conftest import COMFYUI_DIR
from harness import run_ranks, values

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(COMFYUI_DIR, "comfy", "ops.py")), reason=f"needs ComfyUI at {COMFYUI_DIR}")
M, K, N = 37, 64, 48  # an odd row count: the reduce-scatter pads


def _setup(comfy_dir, root):
    """ComfyUI (CPU) and the pack imported in a rank process, with a TP group in the pack's state."""
    import importlib
    import sys
    import types

    sys.path.insert(0, comfy_dir)
    sys.argv = ["main.py", "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.ops

    pack = types.ModuleType("tp2pack")
    pack.__path__ = [root]
    sys.modules["tp2pack"] = pack
    mod = types.SimpleNamespace(comfy=comfy, **{n.rpartition(".")[2]: importlib.import_module("tp2pack." + n) for n in MODULES})
    env = mod.settings.read_tp_env()
    tp = mod.collectives.init_tp_group(env)
    state = mod.state.STATE
    state.env, state.session, state.reduce_dtype, state.int8_gemm = env, types.SimpleNamespace(group=tp), torch.float32, None
    return mod, tp


MODULES = ("nodes.parallel", "nodes.state", "tp2.collectives", "tp2.layers", "tp2.sequence_layout", "tp2.settings")


def _worker(tp_rank, tp_size, comfy_dir, root):
    mod, tp = _setup(comfy_dir, root)
    comfy, parallel, layers, seq = mod.comfy, mod.parallel, mod.layers, mod.sequence_layout
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
    k = K // tp_size
    w_r, x_r = w[:, tp_rank * k : (tp_rank + 1) * k].contiguous(), x[:, tp_rank * k : (tp_rank + 1) * k].contiguous()
    linear = comfy.ops.disable_weight_init.Linear(k, N, bias=False)
    linear.weight = torch.nn.Parameter(w_r, requires_grad=False)
    linear.tp_role = "rowwise"
    layout = seq.RowLayout.plan(M, tp_size, tp_rank)
    core = functools.partial(layers.row_parallel, x_r, w_r, None, tp, None, torch.float32)
    return {
        "adapter": parallel.rowwise_call(linear, x_r),
        "core": core(),
        "scattered": parallel.rowwise_call(linear, x_r, reduce=layout),
        "core_scattered": core(reduce=layout),
        "partial": parallel.rowwise_call(linear, x_r, reduce=layers.PARTIAL),
        "rows": (tp_rank * layout.m, (tp_rank + 1) * layout.m),
        "reference": torch.nn.functional.linear(x, w),
    }


@pytest.mark.parametrize("tp_size", [2, 4])
def test_comfyui_row_parallel_call_is_the_core_row_parallel_linear(tp_size):
    outs = values(run_ranks(_worker, tp_size, COMFYUI_DIR, ROOT))
    full = outs[0]["adapter"]
    assert torch.allclose(full, outs[0]["reference"], rtol=1e-5, atol=1e-5)
    assert sum(o["partial"] for o in outs).allclose(full, rtol=1e-6, atol=1e-6)
    for o in outs:
        assert torch.equal(o["adapter"], o["core"]) and torch.equal(o["adapter"], full)  # one implementation, every rank
        assert torch.equal(o["scattered"], o["core_scattered"])
        a, b = o["rows"]
        mine = full[a:b]
        got = o["scattered"][: mine.shape[0]]
        # this rank's rows of the all-reduce: bit for bit at 2 ranks (a + b either way); gloo's 4-rank reduce-scatter
        # and all-reduce add in different orders, so fp32 rounding differs there
        assert torch.equal(got, mine) if tp_size == 2 else torch.allclose(got, mine, rtol=1e-6, atol=1e-6)


TE_N, TE_K = 200, 128  # an nvfp4 layer whose K splits on whole 16-column blocks at 2 and 4 ranks


def _te_linear(comfy, tensors: dict, k: int):
    """The layer ComfyUI's text encoder builds for an nvfp4 file: MixedPrecisionOps with full_precision_mm (sd1_clip)."""
    layer = comfy.ops.mixed_precision_ops({}, torch.bfloat16, full_precision_mm=True).Linear(k, TE_N, bias=False, device="cpu")
    layer.load_state_dict(dict(tensors), strict=True)
    layer.tp_role = "rowwise"
    return layer


def _nvfp4_writer(root: str):
    """scripts/make_tiny_qwen3vl.py, whose nvfp4 writer makes a quantised layer and a rank's slice of it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_qwen3vl", os.path.join(root, "scripts", "make_tiny_qwen3vl.py"))
    writer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writer)
    return writer


def _te_worker(tp_rank, tp_size, comfy_dir, root):
    mod, tp = _setup(comfy_dir, root)
    g = torch.Generator().manual_seed(1)
    w, pqs = torch.randn(TE_N, TE_K, generator=g).to(torch.bfloat16), (torch.rand(TE_K, generator=g) + 0.5).to(torch.bfloat16)
    writer = _nvfp4_writer(root)
    full = writer.quantize_nvfp4_awq(w, pqs)
    k = TE_K // tp_size
    mine, whole = _te_linear(mod.comfy, writer.slice_nvfp4(full, 1, tp_rank, tp_size), k), _te_linear(mod.comfy, full, TE_K)
    x, w_full = torch.randn(2, 9, TE_K, generator=g), whole.weight.to(dtype=torch.float32).dequantize().double()
    out = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):  # the encoder's fp32; bf16: a narrower compute dtype
            x_r = x[..., tp_rank * k : (tp_rank + 1) * k].to(dtype)
            own = mine(x_r)  # ComfyUI's forward on the slice, summed as the encoder did before row_parallel
            w_r = mine.weight.to(dtype=torch.float32).dequantize()  # the adapter's cast: straight to fp32
            out[dtype] = {
                "adapter": mod.parallel.full_precision_rowwise_call(mine, x_r),
                "core": mod.layers.row_parallel(x_r * mine.pre_quant_scale.to(dtype), w_r, None, tp, None, torch.float32),
                "own_then_reduce": mod.collectives.all_reduce(own.float(), tp).to(own.dtype),
                "one_device": whole(x.to(dtype)),
                "exact": torch.nn.functional.linear((x.to(dtype) * pqs.to(dtype)).double(), w_full),
            }
    return out


@pytest.mark.parametrize("tp_size", [2, 4])
def test_text_encoder_row_parallel_is_the_core_row_parallel_linear(tp_size):
    outs = values(run_ranks(_te_worker, tp_size, COMFYUI_DIR, ROOT))
    for o in outs:
        fp32, bf16 = o[torch.float32], o[torch.bfloat16]
        for got in (fp32, bf16):  # one implementation, every rank
            assert torch.equal(got["adapter"], got["core"]) and torch.equal(got["adapter"], outs[0][got["adapter"].dtype]["adapter"])
        # the encoder's fp32: ComfyUI's own forward and reduce, bit for bit, and one device's output but for the order of the sum
        assert torch.equal(fp32["adapter"], fp32["own_then_reduce"])
        assert torch.allclose(fp32["adapter"], fp32["one_device"], rtol=1e-5, atol=1e-5)
        # bf16: the partial sums reach the reduce in fp32, unrounded, so the result is the exact sum rounded once
        # (half a bf16 ulp, 2**-8 relative); rounding each partial to bf16 first is further off
        exact = bf16["exact"]
        err, err_before = ((bf16[key].double() - exact).abs() for key in ("adapter", "own_then_reduce"))
        assert torch.all(err <= exact.abs() * 2**-8 + 1e-5)
        assert err.max() <= err_before.max() and err.mean() < err_before.mean()
