"""tp2.sequence_layout.RowLayout: every real row is held by exactly one rank, in an order the collectives
reproduce; segments map onto local rows; one piece is the plain contiguous split."""

import pytest
import torch

from tp2.sequence_layout import RowLayout


@pytest.mark.parametrize("full,size,pieces", [(1, 2, 1), (7, 2, 1), (8, 2, 4), (37, 2, 4), (37, 3, 4), (100, 4, 3)])
def test_ranks_hold_every_real_row_once_and_gathers_restore_the_order(full, size, pieces):
    x = torch.arange(full, dtype=torch.float32)[:, None] + 1  # row i holds i + 1; pad rows are 0
    layouts = [RowLayout.plan(full, size, r, pieces) for r in range(size)]
    locals_ = [lay.take(x) for lay in layouts]
    held = torch.cat(locals_).flatten()
    assert sorted(held[held > 0].tolist()) == list(range(1, full + 1))
    lay = layouts[0]
    assert all(loc.shape[0] == lay.local_rows for loc in locals_) and lay.padded == size * lay.local_rows >= full
    # what start_gather_sequence assembles: piece c of every rank, in rank order, at sequence rows [c*P, (c+1)*P)
    m = lay.m
    seq = torch.cat([torch.cat([loc[c * m : (c + 1) * m] for loc in locals_]) for c in range(pieces)])
    assert torch.equal(seq[:full], x) and not seq[full:].any()
    assert sum(lay.valid_rows(c) for c in range(pieces)) == full


def test_one_piece_is_the_plain_split():
    lay = RowLayout.plan(10, 2, 1, 1)
    assert lay.sequence_ranges() == [(5, 10)] and lay.local_rows == 5


def test_segments_map_to_local_rows():
    full, size, pieces = 30, 2, 3
    segments = [(0, 4, 0), (4, 9, 1), (9, 30, 2)]
    tags = torch.tensor([t for a, b, t in segments for _ in range(a, b)], dtype=torch.float32)[:, None]
    for r in range(size):
        lay = RowLayout.plan(full, size, r, pieces)
        local = lay.take(tags + 10) - 10  # pad rows become -10
        covered = torch.zeros(lay.local_rows, dtype=torch.bool)
        for a, b, t in lay.local_segments(segments):
            assert (local[a:b] == t).all()
            covered[a:b] = True
        assert torch.equal(covered, (local != -10).flatten()), "segments must cover exactly the real rows"
