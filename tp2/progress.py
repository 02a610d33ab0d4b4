"""Progress inside a step every rank runs in lockstep: a rank alive but stuck there is named after the step's progress timeout.

A lockstep step (the split decode, sampling) is a series of units every rank goes through together; each rank `mark`s
each unit's start, and the end of its own part of it, right before the collectives that need every rank's part, and its
heartbeat carries "<step>#<marks>". A rank ahead of a peer in the same step that has waited longer than the step's
progress timeout (STUCK_FACTOR times the longest span between two of its own marks in the step, at least STUCK_FLOOR_S)
names the peer stuck. The span before a step's first mark (a model's move to the device) is not timed; a peer stuck
there, or between steps, is left to the collective's own timeout (TP2_TIMEOUT_S). Imports nothing.
"""

from __future__ import annotations

import time

STUCK_FACTOR = 4.0
STUCK_FLOOR_S = 10.0


class Progress:
    """This rank's place in the current step; written by the prompt worker, read by the watcher thread."""

    def __init__(self):
        self._at: tuple[str, int, float | None, float] = ("", 0, None, 0.0)  # (step, marks, last mark, longest span)

    def begin(self, step: str) -> None:
        self._at = (step, 0, None, 0.0)

    def mark(self) -> None:
        step, marks, last, longest = self._at
        now = time.monotonic()
        self._at = (step, marks + 1, now, longest if last is None else max(longest, now - last))

    def end(self) -> None:
        self._at = ("", 0, None, 0.0)

    def token(self) -> str:
        step, marks, _, _ = self._at
        return f"{step}#{marks}"

    def timeout_s(self) -> float:
        return max(STUCK_FLOOR_S, STUCK_FACTOR * self._at[3])

    def stuck(self, rank: int, token: str, now: float) -> str | None:
        """Why peer `rank`, whose heartbeat says `token`, is stuck in this rank's step; None while it is not."""
        step, marks, last, longest = self._at
        their_step, _, theirs = token.rpartition("#")
        if not step or their_step != step or last is None or longest == 0.0 or not theirs.isdigit() or int(theirs) >= marks:
            return None
        waited = now - last
        if waited <= self.timeout_s():
            return None
        return (f"rank {rank} is stuck in {step.rsplit('/', 1)[-1]}: it is alive (its heartbeat goes on) but has not done in "
                f"{waited:.0f} s what took this rank {longest:.1f} s (progress timeout {self.timeout_s():.0f} s); read its log, "
                f"or restart it with scripts/start-tp2.sh restart --rank {rank}")  # fmt: skip
