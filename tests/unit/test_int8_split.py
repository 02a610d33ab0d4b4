"""kernels.int8_split: quantise-then-GEMM gives comfy-kitchen's int8_linear bit for bit (CPU, eager backend), and
quantising a block of rows gives the same rows as quantising them inside a bigger batch (what makes gathering
quantised rows exact). The CUDA counterpart is tests/gpu/test_nccl_tp.py::test_split_int8_linear_matches_int8_linear."""

import pytest
import torch

ck = pytest.importorskip("comfy_kitchen")
from kernels.int8_split import split_int8_linear  # noqa: E402


def _weights(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return q, torch.rand((n, 1), generator=g) * 1e-3 + 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,k,group,bias", [(2, 256, 256, False), (37, 512, 256, True), (64, 1024, 64, False)])
def test_halves_equal_int8_linear(dtype, rows, k, group, bias):
    g = torch.Generator().manual_seed(rows * k)
    x = (torch.randn((rows, k), generator=g) * 3).to(dtype)
    w, ws = _weights(96, k, rows)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    split = split_int8_linear(x, tuple(w.shape), group)
    assert split is not None and split.backend == "eager"
    q, s = split.quantize(x)
    assert q.dtype == torch.int8 and q.shape == (rows, k) and s.shape == (rows, 1) and s.dtype == torch.float32
    got = split.gemm(q, s, w, ws, b, dtype)
    want = ck.int8_linear(x, w, ws, b, out_dtype=dtype, convrot=True, convrot_groupsize=group)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_quantising_rows_apart_equals_quantising_them_together():
    x = (torch.randn((40, 512), generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
    w, ws = _weights(64, 512, 1)
    split = split_int8_linear(x, tuple(w.shape), 256)
    q_all, s_all = split.quantize(x)
    parts = [split.quantize(x[a : a + 10]) for a in range(0, 40, 10)]
    assert torch.equal(torch.cat([p[0] for p in parts]), q_all)
    assert torch.equal(torch.cat([p[1] for p in parts]), s_all)
