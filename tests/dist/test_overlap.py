"""TP2_OVERLAP on real gloo groups: the row-parallel reduce in chunks of rows (each chunk's collective started
while the next computes) gives the bytes of one collective, for the all-reduce and for the reduce-scatter to a
RowLayout (odd rows: pad rows and a 1-row tail), int8 ConvRot layers through comfy-kitchen's eager GEMM."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks, values

M, K, N = 37, 512, 96  # K: two ConvRot groups of 256 per rank


def _worker(tp_rank, tp_size, chunks):
    from kernels.int8_gemm import quantize_int8_convrot, select_int8_gemm
    from tp2.collectives import init_tp_group
    from tp2.layers import ALL_REDUCE, Int8Weight, row_parallel
    from tp2.sequence_layout import RowLayout
    from tp2.settings import read_tp_env

    tp = init_tp_group(read_tp_env())
    g = torch.Generator().manual_seed(tp_rank)
    qdata, scale = quantize_int8_convrot(torch.randn(N, K, generator=g))
    weight, gemm = Int8Weight(qdata, scale, 256), select_int8_gemm("eager")
    x = torch.randn(2, M, K, generator=g).to(torch.bfloat16)
    bias = torch.randn(N, generator=g) if tp_rank == 0 else None
    out = {}
    for n in (1, chunks):
        tp.overlap = n
        y = row_parallel(x, weight, bias, tp, gemm, torch.float32, None, ALL_REDUCE)
        z = row_parallel(x[0], weight, bias, tp, gemm, torch.float32, None, RowLayout.plan(M, tp_size, tp_rank))
        out[n] = (y, z)
    return out, tp_rank


@pytest.mark.parametrize("chunks", [2, 5])
def test_overlapped_reduce_gives_the_bytes_of_one_collective(chunks):
    for out, rank in values(run_ranks(_worker, 2, chunks)):
        (y1, z1), (yc, zc) = out[1], out[chunks]
        assert y1.shape == yc.shape == (2, M, N) and y1.dtype == torch.bfloat16 and torch.equal(y1, yc)
        assert zc.shape == z1.shape == (19, N) and torch.equal(z1, zc)
        mine = y1[0, rank * 19 : min(M, rank * 19 + 19)]  # this rank's rows of the sum, then a pad row of zeros
        assert torch.equal(zc[: len(mine)], mine) and not zc[len(mine) :].any() and mine.abs().sum() > 0
