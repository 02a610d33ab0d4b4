"""The row-parallel linear ComfyUI runs (nodes/parallel.py rowwise_call: a real ComfyUI Linear, its weight cast by
ComfyUI) against the core's RowParallelLinear (tp2/layers.py) on real gloo groups: the same bits for the all-reduce
and for a reduce-scatter to a RowLayout (in pieces), whose rows are this rank's rows of the all-reduce, and partial
sums that add up to it. Both run tp2.layers.row_parallel, the one implementation; this pins that ComfyUI's path is
that one. Needs ComfyUI."""

from __future__ import annotations

import os

import pytest
import torch
from harness import run_ranks, values

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMFYUI_DIR = os.environ.get("COMFYUI_DIR", os.path.expanduser("~/ComfyUI"))
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(COMFYUI_DIR, "comfy", "ops.py")), reason=f"needs ComfyUI at {COMFYUI_DIR}")
M, K, N = 37, 64, 48  # an odd row count: the reduce-scatter pads


def _worker(tp_rank, tp_size, comfy_dir, root):
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
    parallel = importlib.import_module("tp2pack.nodes.parallel")
    state = importlib.import_module("tp2pack.nodes.state").STATE
    coll = importlib.import_module("tp2pack.tp2.collectives")
    layers = importlib.import_module("tp2pack.tp2.layers")
    seq = importlib.import_module("tp2pack.tp2.sequence_layout")

    env = importlib.import_module("tp2pack.tp2.settings").read_tp_env()
    tp = coll.init_tp_group(env)
    state.env, state.session, state.reduce_dtype, state.int8_gemm = env, types.SimpleNamespace(group=tp), torch.float32, None
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
    k = K // tp_size
    w_r, x_r = w[:, tp_rank * k : (tp_rank + 1) * k].contiguous(), x[:, tp_rank * k : (tp_rank + 1) * k].contiguous()
    linear = comfy.ops.disable_weight_init.Linear(k, N, bias=False)
    linear.weight = torch.nn.Parameter(w_r, requires_grad=False)
    linear.tp_role = "rowwise"
    layout = seq.RowLayout.plan(M, tp_size, tp_rank, 2)
    core = layers.RowParallelLinear(w_r, None, tp)
    return {
        "adapter": parallel.rowwise_call(linear, x_r),
        "core": core(x_r),
        "scattered": parallel.rowwise_call(linear, x_r, reduce=layout),
        "core_scattered": core(x_r, reduce=layout),
        "partial": parallel.rowwise_call(linear, x_r, reduce=layers.PARTIAL),
        "ranges": layout.sequence_ranges(),
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
        mine = torch.cat([full[a:b] for a, b in o["ranges"] if a < M])[: o["scattered"].shape[0]]
        got = o["scattered"][: mine.shape[0]]
        # this rank's rows of the all-reduce: bit for bit at 2 ranks (a + b either way); gloo's 4-rank reduce-scatter
        # and all-reduce add in different orders, so fp32 rounding differs there
        assert torch.equal(got, mine) if tp_size == 2 else torch.allclose(got, mine, rtol=1e-6, atol=1e-6)
