"""Progress inside a run, as the heartbeat tells it: a rank alive but stuck is named, and a rank waiting says on whom.

A lockstep step (the split decode, sampling) is a series of units every rank goes through together; each rank `mark`s
each unit's start, and the end of its own part of it, right before the collectives that need every rank's part. Reads
of a rank's weights `tick` (module-wide) so a long load counts as progress. The heartbeat carries "<step>#<marks>.<ticks>",
and "!w" while the rank waits for its peers (a host-side collective, a rendezvous).
- A rank ahead of a peer in the same step that has waited longer than the step's progress timeout (STUCK_FACTOR
  times the longest span between two of its own marks in the step, at least STUCK_FLOOR_S) names the peer stuck.
- A rank waiting while a peer is not, and whose token has not moved, says so every REPORT_S (or half the limit); past the stall limit
  (TP2_STALL_S, else STALL_FACTOR times the slowest unit of the run so far, at least STALL_FLOOR_S, and for a peer
  between steps at least the collective timeout) for both the wait and the peer's stillness, it names the peer stuck.
"""

from __future__ import annotations

import time

STUCK_FACTOR, STUCK_FLOOR_S = 4.0, 10.0
STALL_FACTOR, STALL_FLOOR_S, REPORT_S = 8.0, 60.0, 30.0
WAITING = "!w"
TICKS = [0]  # weights read by this process (tp2.safetensors_io); part of the token, so a long load is progress


def tick() -> None:
    TICKS[0] += 1


class Progress:
    """This rank's place in the current step; written by the prompt worker, read by the watcher thread."""

    def __init__(self, stall_s: float | None = None):
        self._at: tuple[str, int, float | None, float] = ("", 0, None, 0.0)  # (step, marks, last mark, longest span)
        self.stall_s, self.slowest = stall_s, 0.0  # TP2_STALL_S (None: scaled); the run's slowest unit so far
        self.waiting: tuple[str, float] | None = None  # (on what, since when) while this rank waits for its peers
        self.between_s = 0.0  # the least stall limit for a peer between steps (the session sets TP2_TIMEOUT_S)

    def begin(self, step: str) -> None:
        self._at = (step, 0, None, 0.0)

    def mark(self) -> None:
        step, marks, last, longest = self._at
        now = time.monotonic()
        longest = longest if last is None else max(longest, now - last)
        self._at, self.slowest = (step, marks + 1, now, longest), max(self.slowest, longest)

    def end(self) -> None:
        self._at, self.slowest = ("", 0, None, 0.0), 0.0

    def wait_begin(self, what: str) -> None:
        self.waiting = (what, time.monotonic())

    def token(self) -> str:
        step, marks, _, _ = self._at
        return f"{step}#{marks}.{TICKS[0]}" + (WAITING if self.waiting else "")

    def timeout_s(self) -> float:
        return max(STUCK_FLOOR_S, STUCK_FACTOR * self._at[3])

    def stall_limit_s(self, between: bool = False) -> float:
        """TP2_STALL_S, else scaled to the run's pace; a peer `between` steps (in a node, loading) gets at least the
        collective timeout, so a slow load is never a stall unless TP2_STALL_S says so."""
        scaled = max(STALL_FLOOR_S, STALL_FACTOR * self.slowest)
        return self.stall_s or (max(scaled, self.between_s) if between else scaled)

    def report_s(self, between: bool = False) -> float:
        return min(REPORT_S, self.stall_limit_s(between) / 2)

    def stuck(self, rank: int, token: str, now: float) -> str | None:
        """Why peer `rank`, whose heartbeat says `token`, is stuck in this rank's step; None while it is not."""
        step, marks, last, longest = self._at
        their_step, _, theirs = token.removesuffix(WAITING).rpartition("#")
        theirs = theirs.split(".")[0]
        if not step or their_step != step or last is None or longest == 0.0 or not theirs.isdigit() or int(theirs) >= marks:
            return None
        waited = now - last
        if waited <= self.timeout_s():
            return None
        return (f"rank {rank} is stuck in {step.rsplit('/', 1)[-1]}: it is alive (its heartbeat goes on) but has not done in "
                f"{waited:.0f} s what took this rank {longest:.1f} s (progress timeout {self.timeout_s():.0f} s); read its log, "
                f"or restart it with scripts/start-tp2.sh restart --rank {rank}")  # fmt: skip

    def stalled(self, rank: int, token: str, still_s: float, now: float) -> tuple[str, bool] | None:
        """(what to say, whether the run must stop) while this rank waits and peer `rank` (heartbeat `token`, unchanged
        for `still_s`) is not waiting; None when this rank is not waiting, the peer waits too, or for under REPORT_S."""
        if self.waiting is None or token.endswith(WAITING):
            return None
        what, since = self.waiting
        step, _, marks = token.removesuffix(WAITING).rpartition("#")
        waited = now - since
        where = f"in {step.rsplit('/', 1)[-1]} at unit {marks.split('.')[0]}" if step else "between TP steps (in a node, or loading)"
        limit = self.stall_limit_s(between=not step)
        if min(waited, still_s) < self.report_s(between=not step):
            return None
        if min(waited, still_s) > limit:
            return (f"rank {rank} is stuck {where}: it is alive (its heartbeat goes on) but has made no progress for "
                    f"{still_s:.0f} s while this rank waited {waited:.0f} s for it at {what} (stall limit "
                    f"{limit:.0f} s, TP2_STALL_S); its Python stacks are in its log; restart it with "
                    f"scripts/start-tp2.sh restart --rank {rank}", True)  # fmt: skip
        return f"waiting for rank {rank} at {what} for {waited:.0f} s; its last progress was {where}, {still_s:.0f} s ago", False
