"""tp2.nvfp4 and the test generator's nvfp4 writer (scripts/make_tiny_qwen3vl.py) against comfy-kitchen 0.2.31 and
ComfyUI on CPU: the quantiser writes comfy-kitchen's bytes, every
rank's slice loads through ComfyUI's own MixedPrecisionOps.Linear and dequantises to exactly the slice of the full
weight (and is what quantising that slice alone would store), K-sliced partial products sum to the full layer's
output, and the shapes that cannot be split are refused. ComfyUI is imported in this process, in CPU mode."""

import importlib.util
import json
import os
import sys

import pytest
import torch

ck = pytest.importorskip("comfy_kitchen")
from comfy_kitchen.float_utils import from_blocked, to_blocked  # noqa: E402
from conftest import COMFYUI_DIR, ROOT  # noqa: E402

from tp2.nvfp4 import slice_block_scales, swizzle_block_scales, unswizzle_block_scales  # noqa: E402

_spec = importlib.util.spec_from_file_location("make_tiny_qwen3vl", os.path.join(ROOT, "scripts", "make_tiny_qwen3vl.py"))
_writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_writer)
quantize_nvfp4_awq, slice_nvfp4, nvfp4_split_problem = _writer.quantize_nvfp4_awq, _writer.slice_nvfp4, _writer.nvfp4_split_problem

# (n, k): aligned; N not a multiple of 128; N not a multiple of 16 with K/16 = 5 (not a multiple of 4); K/16 = 6
SHAPES = [(256, 128), (200, 96), (1000, 80), (96, 192)]
# Qwen3-VL-32B's decoder linears (hidden 5120, 64 x 128 query heads, 8 x 128 KV heads, FFN 25600) and their style
QWEN3VL_32B = {"q_proj": (8192, 5120, 0), "k_proj": (1024, 5120, 0), "v_proj": (1024, 5120, 0), "o_proj": (5120, 8192, 1),
               "gate_proj": (25600, 5120, 0), "up_proj": (25600, 5120, 0), "down_proj": (5120, 25600, 1)}  # fmt: skip


@pytest.fixture(scope="module")
def comfy():
    if not os.path.isfile(os.path.join(COMFYUI_DIR, "comfy", "ops.py")):
        pytest.skip(f"no ComfyUI checkout at {COMFYUI_DIR}")
    if COMFYUI_DIR not in sys.path:
        sys.path.insert(0, COMFYUI_DIR)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # read when comfy.model_management is first imported
    import comfy.ops
    import comfy.quant_ops

    return comfy


def _weights(n: int, k: int, seed: int, dtype=torch.bfloat16, awq=True):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn((n, k), generator=g) * (torch.rand((n, 1), generator=g) + 0.1)).to(dtype)
    w[0, :16] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -5, 0, -0.0, 1e-9, -1e-9, 3])  # ties
    pqs = (torch.rand(k, generator=g) + 0.5).to(dtype) if awq else None
    return w, pqs


def _comfy_linear(comfy, tensors: dict, n: int, k: int, dtype=torch.float32):
    """The layer the H3 text encoder builds: MixedPrecisionOps with full_precision_mm (comfy/sd1_clip.py), loaded by
    its own _load_quantized_module."""
    layer = comfy.ops.mixed_precision_ops({}, dtype, full_precision_mm=True).Linear(k, n, bias=False, device="cpu")
    result = layer.load_state_dict(dict(tensors), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("awq", [False, True])
def test_quantize_writes_comfys_bytes(comfy, n, k, dtype, awq):
    w, pqs = _weights(n, k, n + k, dtype, awq)
    mine = quantize_nvfp4_awq(w, pqs, input_scale=0.02)
    smoothed = w if pqs is None else w.float() / pqs.float()
    qdata, params = comfy.quant_ops.TensorCoreNVFP4Layout.quantize(smoothed)  # ComfyUI's own rule for the scale
    assert mine["weight"].dtype == torch.uint8 and mine["weight"].shape == (-(-n // 16) * 16, -(-k // 16) * 8)
    assert torch.equal(mine["weight"], qdata)
    assert mine["weight_scale"].dtype == torch.float8_e4m3fn and mine["weight_scale"].shape == params.block_scale.shape
    assert mine["weight_scale"].shape == (-(-n // 128) * 128, -(-k // 64) * 4)
    assert torch.equal(mine["weight_scale"].view(torch.uint8), params.block_scale.view(torch.uint8))
    assert mine["weight_scale_2"].dtype == torch.float32 and mine["weight_scale_2"].shape == ()
    assert torch.equal(mine["weight_scale_2"], params.scale)
    assert mine["input_scale"].shape == () and mine["input_scale"].dtype == torch.float32
    assert json.loads(mine["comfy_quant"].numpy().tobytes()) == {"format": "nvfp4"}
    assert ("pre_quant_scale" in mine) == awq


@pytest.mark.parametrize("rows,cols", [(128, 4), (200, 6), (16, 1), (384, 100), (1008, 5)])
def test_swizzle_is_comfy_kitchens_tiling(rows, cols):
    s = torch.randint(0, 127, (rows, cols), generator=torch.Generator().manual_seed(rows), dtype=torch.uint8)
    s = s.view(torch.float8_e4m3fn)
    theirs = to_blocked(s, flatten=False)
    assert torch.equal(swizzle_block_scales(s).view(torch.uint8), theirs.view(torch.uint8))
    assert torch.equal(unswizzle_block_scales(theirs, rows, cols).view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(from_blocked(theirs, rows, cols).view(torch.uint8), s.view(torch.uint8))


def _cases():
    for n, k in SHAPES:
        for tp_size in (2, 4):
            yield n, k, 0, tp_size
            if nvfp4_split_problem(n, k, 1, tp_size) is None:
                yield n, k, 1, tp_size


@pytest.mark.parametrize("n,k,dim,tp_size", list(_cases()))
def test_slice_dequantizes_to_the_slice(comfy, n, k, dim, tp_size):
    w, pqs = _weights(n, k, 7 * n + k)
    full = quantize_nvfp4_awq(w, pqs, input_scale=0.02)
    want = _comfy_linear(comfy, full, n, k).weight.dequantize()
    smoothed = w.float() / pqs.float()
    size = (n, k)[dim] // tp_size
    for tp_rank in range(tp_size):
        local = slice_nvfp4(full, dim, tp_rank, tp_size, shape=(n, k))
        local_n, local_k = (size, k) if dim == 0 else (n, size)
        got = _comfy_linear(comfy, local, local_n, local_k).weight.dequantize()
        assert got.shape == (local_n, local_k)
        assert torch.equal(got, want.narrow(dim, tp_rank * size, size))
        # bit for bit what comfy-kitchen stores for the rank's slice quantised alone with the full layer's scale
        part = smoothed.narrow(dim, tp_rank * size, size).contiguous()
        qdata, block_scale = ck.quantize_nvfp4(part, full["weight_scale_2"], pad_16x=True)
        assert torch.equal(local["weight"], qdata)
        assert torch.equal(local["weight_scale"].view(torch.uint8), block_scale.view(torch.uint8))
        pqs_want = pqs.narrow(0, tp_rank * size, size) if dim == 1 else pqs
        assert torch.equal(local["pre_quant_scale"], pqs_want)
        for scalar in ("weight_scale_2", "input_scale", "comfy_quant"):
            assert local[scalar] is full[scalar]


# fp32: each rank's partial is an exact K-slice of the same products, so only the summation order differs (1e-5).
# bf16: ComfyUI's F.linear rounds each partial to bf16 before the all-reduce adds them; bf16 keeps 8 significant
# bits, so a sum of tp_size rounded partials is off by a few bf16 ulps of the output's scale: 2**-6 of max|y|.
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2**-6)])
@pytest.mark.parametrize("n,k,tp_size", [(256, 128, 2), (200, 128, 4), (96, 192, 2)])
def test_rowwise_partials_sum_to_the_full_output(comfy, n, k, tp_size, dtype, rtol):
    w, pqs = _weights(n, k, n * k)
    full = quantize_nvfp4_awq(w, pqs)
    x = torch.randn((2, 5, k), generator=torch.Generator().manual_seed(k)).to(dtype)
    with torch.inference_mode():
        want = _comfy_linear(comfy, full, n, k, dtype)(x)
        size = k // tp_size
        parts = [
            _comfy_linear(comfy, slice_nvfp4(full, 1, r, tp_size), n, size, dtype)(x[..., r * size : (r + 1) * size])
            for r in range(tp_size)
        ]
    got = torch.stack([p.float() for p in parts]).sum(0)
    assert got.shape == want.shape == (2, 5, n)
    err = (got - want.float()).abs().max() / want.float().abs().max()
    assert err <= rtol, f"max error {err:.2e} of max|y|"


@pytest.mark.parametrize("n,k,tp_size", [(256, 128, 2), (1000, 80, 4)])
def test_colwise_outputs_concatenate_to_the_full_output(comfy, n, k, tp_size):
    w, pqs = _weights(n, k, n + 3 * k)
    full = quantize_nvfp4_awq(w, pqs)
    x = torch.randn((7, k), generator=torch.Generator().manual_seed(n))
    with torch.inference_mode():
        want = _comfy_linear(comfy, full, n, k)(x)
        size = n // tp_size
        got = torch.cat([_comfy_linear(comfy, slice_nvfp4(full, 0, r, tp_size, shape=(n, k)), size, k)(x) for r in range(tp_size)], -1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_cpu_cannot_run_the_nvfp4_gemm(comfy):
    """Why CPU tests cover nvfp4 only through the dequantising path the text encoder takes (full_precision_mm, and
    ComfyUI disables nvfp4 compute below sm_100): with a quantised input, comfy-kitchen's eager scaled_mm_nvfp4 calls
    torch._scaled_mm_v2, which refuses swizzled scales on CPU with a ValueError its fallback does not catch."""
    full = quantize_nvfp4_awq(*_weights(128, 64, 1))
    layer = comfy.ops.mixed_precision_ops({}, torch.float32, full_precision_mm=False).Linear(64, 128, bias=False, device="cpu")
    layer.load_state_dict(full)
    with pytest.raises(ValueError, match="CPU does not support swizzle"):
        layer(torch.randn(4, 64))


def test_block_scales_of_aligned_splits_are_plain_byte_ranges():
    """The docstring's promise: a rank can read only its bytes when local rows are a multiple of 128 (dim 0) or
    local K / 16 a multiple of 4 (dim 1, one run of 512-byte tiles per 128-row band)."""
    n, k, tp_size = 512, 512, 2
    ws = quantize_nvfp4_awq(_weights(n, k, 5, awq=False)[0], None)["weight_scale"]
    bands, tiles = ws.shape[0] // 128, ws.shape[1] // 4
    for r in range(tp_size):
        rows = slice_block_scales(ws, n, k, 0, r * n // tp_size, (r + 1) * n // tp_size)
        assert torch.equal(rows.view(torch.uint8), ws.narrow(0, r * n // tp_size, n // tp_size).view(torch.uint8))
        cols = slice_block_scales(ws, n, k, 1, r * k // tp_size, (r + 1) * k // tp_size)
        run = ws.view(torch.uint8).reshape(bands, tiles, 512).narrow(1, r * tiles // tp_size, tiles // tp_size)
        assert torch.equal(cols.view(torch.uint8), run.reshape(cols.shape))


@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_qwen3vl_32b_linears_split_on_aligned_byte_ranges(tp_size):
    for name, (n, k, dim) in QWEN3VL_32B.items():
        assert nvfp4_split_problem(n, k, dim, tp_size) is None, name
        assert (n // tp_size) % 128 == 0 if dim == 0 else (k // tp_size // 16) % 4 == 0, name


def test_split_problems_are_refused():
    assert nvfp4_split_problem(1000, 80, 0, 2) is None
    assert nvfp4_split_problem(1000, 80, 0, 3) == "its 1000 output rows are not divisible by tp_size=3. Use tp_size 2, 4 or 8."
    assert nvfp4_split_problem(96, 100, 1, 3) == ("its input dim K=100 is not divisible by tp_size=3. Run this layer unsplit (tp_size 1).")
    assert nvfp4_split_problem(96, 96, 1, 4) == (
        "the local K (24) is not a multiple of 16, so a rank's slice would cut a 16-column nvfp4 block (one fp8 "
        "block scale per 16 input columns). Use tp_size 2."
    )
    assert "Use tp_size 2 or 4." in nvfp4_split_problem(96, 64, 1, 8)
    full = quantize_nvfp4_awq(*_weights(1000, 80, 2))
    with pytest.raises(ValueError, match=r"Cannot split an nvfp4 weight \[1000, 80\] along dim 1: the local K \(40\)"):
        slice_nvfp4(full, 1, 0, 2, shape=(1000, 80))
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, 2\), got 2"):
        slice_nvfp4(full, 0, 2, 2, shape=(1000, 80))
    with pytest.raises(ValueError, match=r"logical shape \[1000, 96\] stores uint8 \[1008, 48\]"):
        slice_nvfp4(full, 0, 0, 2, shape=(1000, 96))
    with pytest.raises(ValueError, match=r"got \['bias', 'weight'"):
        slice_nvfp4({"weight": full["weight"], "bias": torch.zeros(1000)}, 0, 0, 2)
    with pytest.raises(ValueError, match=r"needs 1024 x 8 in the swizzled layout.*row-major scales\?"):
        slice_nvfp4({**full, "weight_scale": torch.zeros(1000, 5, dtype=torch.uint8)}, 0, 0, 2, shape=(1000, 80))
