"""TP2_WIRE on real gloo groups: the compressed row-parallel sums (tp2/wire.py) are the same bytes on every rank, the
same in chunks as whole, the same rows through the reduce-scatter as through the all-reduce, and near the exact sum."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks, values

M, K, N = 37, 512, 128  # K: two ConvRot groups of 256 per rank; N: whole groups of both formats


def _worker(tp_rank, tp_size, wire):
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
    out = {}
    for w, n in (("exact", 1), (wire, 1), (wire, 3)):
        tp.wire, tp.overlap = w, n
        y = row_parallel(x, weight, None, tp, gemm, torch.float32, None, ALL_REDUCE)
        z = row_parallel(x[0], weight, None, tp, gemm, torch.float32, None, RowLayout.plan(M, tp_size, tp_rank))
        out[w, n] = (y, z)
    return out, tp_rank


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.float(), got.float()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


@pytest.mark.parametrize("wire,min_db", [("int8", 35.0), ("int4", 12.0)])
def test_every_rank_holds_the_same_bytes_chunked_or_whole(wire, min_db):
    got = values(run_ranks(_worker, 2, wire))
    (a, _), (b, _) = sorted(got, key=lambda v: v[1])
    for key in a:
        assert torch.equal(a[key][0], b[key][0]), key  # the all-reduce: the same bytes on both ranks
    (exact, _), (whole, zw), (chunked, zc) = a["exact", 1], a[wire, 1], a[wire, 3]
    assert torch.equal(whole, chunked) and torch.equal(zw, zc)  # a group never crosses a row
    assert not torch.equal(whole, exact)  # it is the compressed wire that ran
    assert sqnr_db(exact, whole) >= min_db, sqnr_db(exact, whole)
    for out, rank in got:  # the reduce-scatter's rows are the all-reduce's rows, then zero pad rows
        z, mine = out[wire, 1][1], out[wire, 1][0][0, rank * 19 : min(M, rank * 19 + 19)]
        assert torch.equal(z[: len(mine)], mine) and not z[len(mine) :].any()
