"""How sequence parallelism deals a token sequence out to the ranks, and pads what a reduce-scatter hands back.

The sequence is zero-padded to `size * m` rows, m = ceil(full / size), and rank r holds rows [r*m, (r+1)*m): an
all-gather of every rank's rows in rank order is the padded sequence. Pad rows sit at the end; they stay zero in
the stream and are never mixed with real rows (every op on the local rows is row-wise; gathers drop them).
`chunk_bounds` cuts a run of rows into chunks that row-wise work (the MLP) takes one after another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowLayout:
    full: int  # real rows in the sequence
    size: int  # ranks
    rank: int
    m: int  # rows per rank

    @staticmethod
    def plan(full: int, size: int, rank: int) -> RowLayout:
        return RowLayout(full, size, rank, max(1, -(-full // size)))

    @property
    def padded(self) -> int:
        return self.size * self.m

    def local_segments(self, segments) -> list[tuple[int, int, int]]:
        """Sequence segments [(start, stop, tag)] as this rank's local row ranges (pad rows in none)."""
        return clip_segments(segments, self.rank * self.m, min((self.rank + 1) * self.m, self.full))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the whole sequence `x` [full, ...], zero rows where it is padded (a new tensor)."""
        local = x.new_zeros((self.m, *x.shape[1:]))
        lo, hi = self.rank * self.m, min((self.rank + 1) * self.m, self.full)
        if hi > lo:
            local[: hi - lo] = x[lo:hi]
        return local

    def pad(self, y: torch.Tensor) -> torch.Tensor:
        """The sequence's real rows `y` [full, ...] with zero rows up to [padded, ...], for a reduce-scatter to this layout."""
        return torch.nn.functional.pad(y, (0, 0, 0, self.padded - y.shape[0])) if y.shape[0] < self.padded else y

    def every_ranks_rows(self, partial, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of every rank's block of `partial(lo, hi)` (the sequence's rows [lo, hi)), stacked in rank
        order [size * (b - a), ...] for a reduce-scatter; rows past `full` (pad rows) are zero."""
        both = None
        for r in range(self.size):
            lo, hi = r * self.m + a, min(r * self.m + b, self.full)
            if hi > lo:
                y = partial(min(lo, max(0, hi - 2)), hi)[lo - hi :]  # a 1-row GEMM would take another kernel path
                both = y.new_zeros((self.size * (b - a), y.shape[1])) if both is None else both
                both[r * (b - a) : r * (b - a) + hi - lo] = y
        return both


def clip_segments(segments, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Sequence segments [(start, stop, tag)] within rows [lo, hi), counted from lo."""
    clipped = ((max(a, lo), min(b, hi), tag) for a, b, tag in segments)
    return [(a - lo, b - lo, tag) for a, b, tag in clipped if b > a]


def chunk_bounds(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """[start, stop) chunks of `rows` rows, as few as hold at most `chunk_rows` each, sizes within one row of each
    other, and none of fewer than 2 rows (a 1-row GEMM takes another kernel path; so 5 rows by 2 are 3 + 2):
    [(0, rows)] when they fit in one."""
    n = max(1, min(-(-rows // max(1, chunk_rows)), rows // 2))
    base, extra = divmod(rows, n)  # the first `extra` chunks take one row more
    return [(i * base + min(i, extra), (i + 1) * base + min(i + 1, extra)) for i in range(n)]
