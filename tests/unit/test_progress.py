"""tp2/progress.py: when a waiting rank reports a peer, and when it names the peer stuck (no process groups)."""

from __future__ import annotations

from tp2.progress import Progress


def test_a_waiting_rank_reports_then_names_a_peer_that_does_not_move():
    p = Progress(stall_s=40.0)
    p.begin("run/sampler1")
    p.wait_begin("the all-reduce")
    since = p.waiting[1]
    assert p.stalled(1, "run/sampler1#5.3", 19.0, since + 19) is None  # under half the limit: nothing yet
    text, stop = p.stalled(1, "run/sampler1#5.3", 25.0, since + 25)
    assert not stop and text.startswith(
        "waiting for rank 1 at the all-reduce for 25 s; its last progress was in sampler1 at unit 5, 25 s ago"
    )
    text, stop = p.stalled(1, "run/sampler1#5.3", 41.0, since + 41)
    assert stop and text.startswith("rank 1 is stuck in sampler1 at unit 5: it is alive") and "stall limit 40 s" in text
    assert p.stalled(1, "run/sampler1#5.3!w", 100.0, since + 100) is None  # the peer waits too: not its fault
    p.waiting = None  # the wait is over
    assert p.stalled(1, "run/sampler1#5.3", 100.0, since + 100) is None  # this rank is not waiting


def test_the_stall_limit_scales_with_the_runs_slowest_unit():
    p = Progress()
    assert p.stall_limit_s() == 60.0  # the floor
    p.slowest = 20.0
    assert p.stall_limit_s() == 160.0 and p.report_s() == 30.0
    p.end()
    assert p.stall_limit_s() == 60.0


def test_a_peer_between_steps_gets_at_least_the_collective_timeout_unless_the_user_says():
    p = Progress()
    p.between_s = 300.0
    assert p.stall_limit_s() == 60.0 and p.stall_limit_s(between=True) == 300.0  # a slow load is no stall
    p.wait_begin("the rendezvous 'sampler1'")
    since = p.waiting[1]
    text, stop = p.stalled(1, "#0.7", 120.0, since + 120)
    assert not stop and "between TP steps" in text
    p.stall_s = 12.0
    assert p.stall_limit_s(between=True) == 12.0 and p.stalled(1, "#0.7", 13.0, since + 13)[1]
