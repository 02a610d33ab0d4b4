"""TP2_OVERLAP and TP2_WIRE on real gloo groups, int8 ConvRot layers through comfy-kitchen's eager GEMM: the
row-parallel reduce in chunks of rows (each chunk's collective started while the next computes) gives the bytes of
one collective, for the all-reduce and for the reduce-scatter to a RowLayout (odd rows: pad rows and a 1-row tail);
the compressed wires (tp2/wire.py) give every rank the same bytes, chunked or whole, the reduce-scatter's rows are the
all-reduce's, and the sums stay near the exact ones."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks, values

M, K, N = 37, 512, 128  # K: two ConvRot groups of 256 per rank; N: whole groups of every wire format


def _worker(tp_rank, tp_size, runs):
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
    for wire, chunks in runs:
        tp.wire, tp.overlap = wire, chunks
        y = row_parallel(x, weight, bias, tp, gemm, torch.float32, None, ALL_REDUCE)
        z = row_parallel(x[0], weight, bias, tp, gemm, torch.float32, None, RowLayout.plan(M, tp_size, tp_rank))
        out[wire, chunks] = (y, z)
    return out, tp_rank


def _rows_of_the_sum(out, rank, run):
    """This rank's reduce-scatter rows and its rows of the all-reduce (19 a rank, the last one then a zero pad row)."""
    (y, z), mine = out[run], out[run][0][0, rank * 19 : min(M, rank * 19 + 19)]
    return z, mine


@pytest.mark.parametrize("chunks", [2, 5])
def test_overlapped_reduce_gives_the_bytes_of_one_collective(chunks):
    for out, rank in values(run_ranks(_worker, 2, [("exact", 1), ("exact", chunks)])):
        (y1, z1), (yc, zc) = out["exact", 1], out["exact", chunks]
        assert y1.shape == yc.shape == (2, M, N) and y1.dtype == torch.bfloat16 and torch.equal(y1, yc)
        assert zc.shape == z1.shape == (19, N) and torch.equal(z1, zc)
        z, mine = _rows_of_the_sum(out, rank, ("exact", chunks))
        assert torch.equal(z[: len(mine)], mine) and not z[len(mine) :].any() and mine.abs().sum() > 0


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.float(), got.float()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


@pytest.mark.parametrize("wire,min_db", [("int8", 35.0)])
def test_compressed_wire_gives_every_rank_the_same_bytes_chunked_or_whole(wire, min_db):
    got = values(run_ranks(_worker, 2, [("exact", 1), (wire, 1), (wire, 3)]))
    (a, _), (b, _) = sorted(got, key=lambda v: v[1])
    for key in a:
        assert torch.equal(a[key][0], b[key][0]), key  # the all-reduce: the same bytes on both ranks
    (exact, _), (whole, zw), (chunked, zc) = a["exact", 1], a[wire, 1], a[wire, 3]
    assert torch.equal(whole, chunked) and torch.equal(zw, zc)  # a group never crosses a row
    assert not torch.equal(whole, exact) and sqnr_db(exact, whole) >= min_db, sqnr_db(exact, whole)  # the wire ran, near exact
    for out, rank in got:
        z, mine = _rows_of_the_sum(out, rank, (wire, 1))
        assert torch.equal(z[: len(mine)], mine) and not z[len(mine) :].any()
