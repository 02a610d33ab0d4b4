"""tp2.sequence_layout.RowLayout: every real row is held by exactly one rank, in an order an all-gather in rank
order reproduces (the plain contiguous split); segments map onto local rows."""

import pytest
import torch

from tp2.sequence_layout import RowLayout, chunk_bounds


@pytest.mark.parametrize("full,size", [(1, 2), (7, 2), (8, 2), (37, 2), (37, 3), (100, 4)])
def test_ranks_hold_every_real_row_once_and_gathers_restore_the_order(full, size):
    x = torch.arange(full, dtype=torch.float32)[:, None] + 1  # row i holds i + 1; pad rows are 0
    layouts = [RowLayout.plan(full, size, r) for r in range(size)]
    locals_ = [lay.take(x) for lay in layouts]
    held = torch.cat(locals_).flatten()
    assert sorted(held[held > 0].tolist()) == list(range(1, full + 1))
    lay = layouts[0]
    assert all(loc.shape[0] == lay.m for loc in locals_) and lay.padded == size * lay.m >= full
    seq = torch.cat(locals_)  # what an all-gather in rank order assembles
    assert torch.equal(seq[:full], x) and not seq[full:].any()


def test_the_split_is_contiguous():
    lay = RowLayout.plan(10, 2, 1)
    assert torch.equal(lay.take(torch.arange(10)[:, None]).flatten(), torch.arange(5, 10)) and lay.m == 5


def test_segments_map_to_local_rows():
    full, size = 29, 3
    segments = [(0, 4, 0), (4, 9, 1), (9, 29, 2)]
    tags = torch.tensor([t for a, b, t in segments for _ in range(a, b)], dtype=torch.float32)[:, None]
    for r in range(size):
        lay = RowLayout.plan(full, size, r)
        local = lay.take(tags + 10) - 10  # pad rows become -10
        covered = torch.zeros(lay.m, dtype=torch.bool)
        for a, b, t in lay.local_segments(segments):
            assert (local[a:b] == t).all()
            covered[a:b] = True
        assert torch.equal(covered, (local != -10).flatten()), "segments must cover exactly the real rows"


@pytest.mark.parametrize("rows,chunk_rows", [(0, 4), (1, 2), (5, 2), (10, 3), (15100, 16384), (16385, 16384), (219742, 16384)])
def test_chunks_tile_the_rows_in_as_few_even_chunks_of_two_rows_or_more(rows, chunk_rows):
    chunks = chunk_bounds(rows, chunk_rows)
    assert chunks[0][0] == 0 and chunks[-1][1] == rows and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    sizes = [b - a for a, b in chunks]
    assert max(sizes) - min(sizes) <= 1
    if rows >= 2:
        assert min(sizes) >= 2  # a 1-row GEMM would take another kernel path (other bits)
    if len(chunks) > 1:
        assert len(chunks) == min(-(-rows // chunk_rows), rows // 2)
        assert max(sizes) <= chunk_rows or min(sizes) == 2
    assert (len(chunks) == 1) == (rows <= chunk_rows or rows < 4)


def test_long_sequences_are_chunked_and_short_ones_are_not():
    assert chunk_bounds(15100, 16384) == [(0, 15100)]  # 832x480x124: one chunk, today's path
    assert len(chunk_bounds(219742, 16384)) == 14  # 1920x1088x362 on one rank: 14 chunks of ~15,700 rows
