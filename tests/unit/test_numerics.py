"""tp2/numerics.py on the CPU with comfy-kitchen's eager kernels: a healthy int8 path passes with margin at every
tp_size, and each kind of wrong part (GEMM rows swapped, attention on the wrong keys, a NaN) fails, named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import select_int8_gemm
from kernels.int8_gemm import quantize_int8_convrot
from tp2.numerics import MIN_DB, BlockPath, check_block


def _rope(q, k, table, qw, kw, eps):
    import comfy_kitchen as ck

    ck.rms_rope_split_half_(q[None], k[None], table, qw, kw, epsilon=eps, rot_dim=2 * table.shape[-3])


def _sdpa(q, k, v, heads):
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, q.shape[2], -1)


def _path(gemm=None, attention=_sdpa, dtype=torch.bfloat16):
    return BlockPath(gemm or select_int8_gemm("eager"), quantize_int8_convrot, _rope, attention, None, dtype, torch.float32)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_healthy_int8_path_passes_with_margin(tp_size, dtype):
    report = check_block(_path(dtype=dtype), torch.device("cpu"), tp_size, "cpu")
    assert not report.failing, report.summary()
    assert min(report.parts_db.values()) > MIN_DB + 5, report.summary()  # 30+ dB: the threshold is not marginal


@pytest.mark.parametrize("shares", [(3, 1), (17, 11), (5, 1, 1, 1)], ids=str)
def test_uneven_shares_check_each_ranks_own_widths(shares):
    """Each simulated rank holds its share's widths (3:1: rank 0 six heads, rank 1 two), and the path still passes."""
    report = check_block(_path(), torch.device("cpu"), len(shares), "cpu", shares=shares)
    assert not report.failing and min(report.parts_db.values()) > MIN_DB + 5, report.summary()


def test_swapped_gemm_rows_fail_as_the_gemm():
    good = select_int8_gemm("eager")
    report = check_block(_path(gemm=lambda *a: good(*a).roll(16, 0)), torch.device("cpu"), 2, "cpu")
    assert report.failing == ["int8 GEMM", "block"], report.summary()


def test_attention_on_the_wrong_keys_fails_as_the_attention():
    report = check_block(_path(attention=lambda q, k, v, h: _sdpa(q, k.roll(1, 2), v, h)), torch.device("cpu"), 2, "cpu")
    assert "attention" in report.failing and "int8 GEMM" not in report.failing, report.summary()


def test_a_nan_fails():
    good = select_int8_gemm("eager")

    def nan_gemm(*a):
        y = good(*a)
        y[0, 0] = float("nan")
        return y

    report = check_block(_path(gemm=nan_gemm), torch.device("cpu"), 2, "cpu")
    assert "int8 GEMM" in report.failing and "nan dB" in report.summary(), report.summary()


def test_the_check_runs_the_wire_the_ranks_will_use():
    """TP2_WIRE=int8 (tp2/wire.py): the check's row-parallel sums go through the int8 wire as every rank makes them;
    the block moves from the exact sum's result, by about the wire's rounding, and still passes with margin."""
    import dataclasses

    exact = check_block(_path(), torch.device("cpu"), 2, "cpu")
    int8 = check_block(dataclasses.replace(_path(), wire="int8"), torch.device("cpu"), 2, "cpu")
    assert not int8.failing and int8.parts_db["block"] > MIN_DB + 5, int8.summary()
    assert 0 < exact.parts_db["block"] - int8.parts_db["block"] < 3, (exact.summary(), int8.summary())
