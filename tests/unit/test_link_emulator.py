"""The link emulator's link on the CPU (scripts/bench/link_emulator.py): it delivers the bandwidth and latency it is
set to, holds one collective at a time, and a collective started before compute that takes longer is hidden behind
it. Through tp2.collectives' own entry points, on a lone rank (no process group). Time limits are generous and
scale with the machine's load (conftest.slack)."""

from __future__ import annotations

import time

import torch
from conftest import slack

from scripts.bench.link_emulator import EmulatedDist, Link, collectives_through, lone_rank
from tp2 import collectives
from tp2.collectives import all_reduce, start_all_gather_rows, start_reduce_scatter_rows

MB = 10**6


def _rank(link: Link, records=None):
    shim = EmulatedDist(0, 2, link, records, collectives.__file__)
    return collectives_through(collectives, shim), lone_rank(collectives, 0, 2, torch.device("cpu"))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_the_set_bandwidth_is_what_it_delivers():
    t = torch.zeros(100 * MB // 4)  # 100 MB of fp32
    emulated, tp = _rank(Link(1.0))
    with emulated:
        took = _timed(lambda: all_reduce(t, tp))  # bus factor 1 at 2 ranks: 0.1 s
        halves = _timed(lambda: start_reduce_scatter_rows(t.view(2, -1), tp).result())  # (n-1)/n of the whole: 0.05 s
    assert 0.1 <= took < 0.1 + 0.15 * slack(), took
    assert 0.05 <= halves < 0.05 + 0.15 * slack(), halves


def test_the_latency_is_paid_per_collective_and_the_link_is_serial():
    emulated, tp = _rank(Link(1.0, latency_s=0.01))
    small, big = torch.zeros(256), torch.zeros(50 * MB // 4)
    with emulated:
        latency = _timed(lambda: [all_reduce(small, tp) for _ in range(10)])
        pending = [all_reduce(big, tp, wait=False) for _ in range(2)]  # both started at once: they queue, 2 x 0.06 s
        queued = _timed(lambda: [p.result() for p in pending])
    assert 0.1 <= latency < 0.1 + 0.15 * slack(), latency
    assert 0.11 <= queued < 0.12 + 0.15 * slack(), queued


def test_a_collective_started_before_longer_compute_is_hidden():
    t = torch.zeros(50 * MB // 4)
    emulated, tp = _rank(Link(0.25))  # 0.2 s on the link

    def compute(seconds: float) -> None:
        a, end = torch.randn(64, 64), time.perf_counter() + seconds
        while time.perf_counter() < end:
            a = torch.tanh(a @ a)

    with emulated:
        overlapped = _timed(lambda: (p := all_reduce(t, tp, wait=False), compute(0.3), p.result()))
        in_turn = _timed(lambda: (all_reduce(t, tp), compute(0.3)))
    assert in_turn >= 0.5, in_turn
    assert overlapped < 0.3 + 0.1 * slack() < in_turn, (overlapped, in_turn)


def test_values_and_records_of_each_collective():
    records = []
    emulated, tp = _rank(Link(1000.0), records)
    rows = torch.arange(12.0).view(4, 3)
    with emulated:
        summed = all_reduce(rows.clone(), tp)  # this rank's partial sum, as it is
        mine = start_reduce_scatter_rows(rows.clone(), tp).result()
        pending = start_all_gather_rows(rows[:2].clone(), tp)
        all_reduce(torch.zeros(8), tp)
        gathered = pending.result()
    assert torch.equal(summed, rows) and torch.equal(mine, rows[:2]) and torch.equal(gathered, torch.cat([rows[:2], rows[:2]]))
    assert [(c.op, c.shape, c.nbytes, c.issued_before_wait) for c in records] == [
        ("all_reduce", (4, 3), 48, 0),
        ("reduce_scatter", (4, 3), 48, 0),
        ("all_gather", (2, 3), 48, 1),  # waited after the next all-reduce was issued: overlapped
        ("all_reduce", (8,), 32, 0),
    ]
    assert records[0].site.startswith("test_link_emulator.py:") and records[0].site.endswith(" test_values_and_records_of_each_collective")
