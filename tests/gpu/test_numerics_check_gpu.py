"""The numerics check (nodes/numerics_check.py) on a real GPU: every int8 path the pack can take here passes, a
wrong int8 GEMM is refused, and a recalled check costs nothing. Prints each report (the figures in
docs/PERFORMANCE.md come from `pytest tests/gpu/test_numerics_check_gpu.py -s`). Needs ComfyUI with H3 at $COMFYUI_DIR."""

from __future__ import annotations

import os
import sys
import time
import types

import pytest
import torch
from gpu_pack import NEEDS_GPU_AND_H3, ROOT, pack_module

sys.path.insert(0, os.path.join(ROOT, "tests", "comfy", "fixtures"))
from tp2_seams import broken_int8  # noqa: E402 - the comfy tests' broken GEMM (TP2_TEST_BREAK_INT8_RANKS)

pytestmark = NEEDS_GPU_AND_H3


@pytest.fixture(scope="module")
def pack():
    return types.SimpleNamespace(
        check=pack_module("nodes.numerics_check"),
        state=pack_module("nodes.state").STATE,
        kernels=pack_module("kernels"),
        errors=pack_module("tp2.errors"),
        env=pack_module("tp2.collectives").TPEnv,
        attention=pack_module("kernels.attention"),
    )


def _configure(pack, tp_size, kernel, attention, fused, broken=False, monkeypatch=None):
    s = pack.state
    s.env, s.device = pack.env(0, tp_size, "127.0.0.1", 29511, 30.0), torch.device("cuda", torch.cuda.current_device())
    import comfy.quant_ops  # noqa: F401 - as in ComfyUI: it disables comfy-kitchen's triton backend ...
    from comfy_kitchen import registry

    (registry.enable if kernel == "triton" else registry.disable)("triton")  # ... unless --enable-triton-backend
    gemm = pack.kernels.select_int8_gemm(kernel)
    if broken:  # as tests/comfy/fixtures/tp2_seams breaks it
        gemm = broken_int8(gemm)
    s.int8_gemm, s.reduce_dtype = gemm, torch.float32
    for name in ("TP2_SEQUENCE_PARALLEL", "TP2_SP_FUSED_NORM"):
        monkeypatch.setenv(name, "1" if fused else "0")
    monkeypatch.setenv("TP2_ATTN_BACKEND", attention)
    pack.attention._chosen.clear()
    pack.check.attention_override.cache_clear()
    pack.check._checked.cache_clear()


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize(
    "kernel,attention,fused", [("auto", "sdpa", False), ("auto", "ck", False), ("auto", "ck", True), ("triton", "sdpa", False)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp32: what compute capability < 8.0 runs
def test_every_int8_path_here_passes_in_well_under_a_second(pack, monkeypatch, tp_size, kernel, attention, fused, dtype):
    _configure(pack, tp_size, kernel, attention, fused, monkeypatch=monkeypatch)
    pack.check.check_int8_path(dtype)  # the first call also compiles and picks kernels
    pack.check._checked.cache_clear()
    t0 = time.perf_counter()
    report = pack.check.check_int8_path(dtype)
    secs = time.perf_counter() - t0
    print(f"\ntp{tp_size} {dtype} {kernel}/{attention}/fused={fused}: {report.summary()} [{secs:.3f} s warm]")
    assert not report.failing and secs < 1.0, report.summary()
    t0 = time.perf_counter()
    pack.check.check_int8_path(dtype)  # recalled, not rerun
    assert time.perf_counter() - t0 < 0.01


def test_a_wrong_int8_gemm_is_refused_with_the_gpu_and_the_db(pack, monkeypatch):
    _configure(pack, 2, "auto", "sdpa", False, broken=True, monkeypatch=monkeypatch)
    with pytest.raises(pack.errors.NumericsError) as e:
        pack.check.check_int8_path(torch.bfloat16)
    msg = str(e.value)
    print("\n" + msg)
    assert torch.cuda.get_device_name() in msg and "compute capability" in msg and "int8 GEMM measured" in msg, msg
