"""How sequence parallelism deals a token sequence out to the ranks, and the collectives that move it, in pieces.

The sequence is zero-padded to `pieces * size * m` rows and cut into `pieces` consecutive blocks of `size * m`
rows; rank r holds the r-th run of m rows of every block:

    sequence:  | piece 0: r0 r1 ... | piece 1: r0 r1 ... | ...        rank r's rows: its run of each piece, in order

With one piece this is the plain split (rank r holds rows r*n .. (r+1)*n). With more, piece c's all-gather fills
sequence rows [c*P, (c+1)*P) in place and its reduce-scatter hands every rank its run of that piece, so a GEMM on
piece c+1 can run while piece c's collective is in flight, and nothing is copied to reorder rows. Pad rows sit at
the end of the sequence; they stay zero in the stream and are never mixed with real rows (every op on the local
rows is row-wise; gathers drop them). `chunk_bounds` cuts a run of rows into chunks that row-wise work (the MLP)
takes one after another, so its temporaries never span the whole sequence. Imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .collectives import Pending, TPGroup, start_all_gather_rows, start_reduce_scatter_rows


@dataclass(frozen=True)
class RowLayout:
    full: int  # real rows in the sequence
    size: int  # ranks
    rank: int
    pieces: int
    m: int  # rows per rank per piece

    @staticmethod
    def plan(full: int, size: int, rank: int, pieces: int) -> RowLayout:
        grain = size * pieces
        return RowLayout(full, size, rank, pieces, max(1, -(-full // grain)))

    @property
    def piece_rows(self) -> int:  # P: rows of one piece of the sequence
        return self.size * self.m

    @property
    def padded(self) -> int:
        return self.pieces * self.piece_rows

    @property
    def local_rows(self) -> int:
        return self.pieces * self.m

    def sequence_ranges(self) -> list[tuple[int, int]]:
        """This rank's rows as [start, stop) ranges of the padded sequence, in local order."""
        return [(c * self.piece_rows + self.rank * self.m, c * self.piece_rows + (self.rank + 1) * self.m) for c in range(self.pieces)]

    def valid_rows(self, c: int) -> int:
        """Real (not pad) rows in piece c of the sequence; pad rows are its trailing ones."""
        return max(0, min(self.piece_rows, self.full - c * self.piece_rows))

    def local_segments(self, segments) -> list[tuple[int, int, int]]:
        """Sequence segments [(start, stop, tag)] as this rank's local row ranges, in local order (pad rows in none)."""
        out = []
        for c, (lo, hi) in enumerate(self.sequence_ranges()):
            for a, b, tag in segments:
                a, b = max(a, lo), min(b, hi, self.full)
                if b > a:
                    out.append((a - lo + c * self.m, b - lo + c * self.m, tag))
        return out

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the whole sequence `x` [full, ...], zero rows where it is padded (a new tensor)."""
        local = x.new_zeros((self.local_rows, *x.shape[1:]))
        for c, (lo, hi) in enumerate(self.sequence_ranges()):
            hi = min(hi, self.full)
            if hi > lo:
                local[c * self.m : c * self.m + hi - lo] = x[lo:hi]
        return local


def chunk_bounds(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """[start, stop) chunks of `rows` rows, as few as hold at most `chunk_rows` each, sizes within one row of each
    other, and none of fewer than 2 rows (a 1-row GEMM takes another kernel path; so 5 rows by 2 are 3 + 2):
    [(0, rows)] when they fit in one."""
    n = max(1, min(-(-rows // max(1, chunk_rows)), rows // 2))
    base, extra = divmod(rows, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


class PiecesInFlight:
    """One collective per piece filling one tensor, `rows_per_piece` rows each, in order."""

    def __init__(self, out: torch.Tensor, pending: list[Pending], rows_per_piece: int):
        self.out, self.pending, self.rows_per_piece, self.done = out, pending, rows_per_piece, 0

    def result(self, stop: int | None = None) -> torch.Tensor:
        """The tensor, once the pieces holding rows [0, stop) (default: all) are in; later pieces may still be
        in flight."""
        wanted = len(self.pending) if stop is None else min(len(self.pending), -(-stop // self.rows_per_piece))
        for p in self.pending[self.done : wanted]:
            p.result()
        self.done = max(self.done, wanted)
        return self.out


def start_gather_sequence(local: torch.Tensor, layout: RowLayout, tp: TPGroup) -> PiecesInFlight:
    """All ranks' rows in sequence order, [padded, ...]: one all-gather per piece, each into its place. A world of
    one in one piece gathers nothing: its rows are the sequence (no copy)."""
    if layout.size == 1 and layout.pieces == 1:
        return PiecesInFlight(local, [], layout.piece_rows)
    out = local.new_empty((layout.padded, *local.shape[1:]))
    m, p = layout.m, layout.piece_rows
    pending = [start_all_gather_rows(local[c * m : (c + 1) * m], tp, out=out[c * p : (c + 1) * p]) for c in range(layout.pieces)]
    return PiecesInFlight(out, pending, p)


def gather_row_scales(local: torch.Tensor, layout: RowLayout, tp: TPGroup) -> torch.Tensor:
    """Small per-row values (e.g. int8 row scales) of all ranks in sequence order: one all-gather, then reorder."""
    got = start_all_gather_rows(local, tp).result()  # rank-major: [size, pieces, m, ...]
    shaped = got.view(layout.size, layout.pieces, layout.m, *local.shape[1:])
    return shaped.transpose(0, 1).reshape(layout.padded, *local.shape[1:])


def reduce_scatter_sequence(piece_output: Callable[[int], torch.Tensor | None], layout: RowLayout, tp: TPGroup) -> torch.Tensor:
    """Sum over ranks of a per-piece partial output, this rank keeping its rows, [local_rows, N].

    `piece_output(c)` computes piece c's partial output for its real rows ([valid_rows(c), N], or None when it has
    none); each piece's reduce-scatter starts as soon as it is computed, while the next piece computes."""
    if layout.size == 1 and layout.pieces == 1:  # a world of one in one piece: nothing to sum, no copy
        return piece_output(0)
    out, pending, m, p = None, [], layout.m, layout.piece_rows
    for c in range(layout.pieces):
        y = piece_output(c) if layout.valid_rows(c) else None
        if out is None:
            if y is None:
                raise ValueError("the first piece of a sequence has no real rows")
            out = y.new_empty((layout.local_rows, y.shape[1]))
        if y is None:
            y = out.new_zeros((p, out.shape[1]))
        elif y.shape[0] < p:
            y = torch.nn.functional.pad(y, (0, 0, 0, p - y.shape[0]))
        pending.append(start_reduce_scatter_rows(y, tp, out=out[c * m : (c + 1) * m]))
    return PiecesInFlight(out, pending, m).result()
