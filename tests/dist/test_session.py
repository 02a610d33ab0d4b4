"""TPSession on real gloo groups: store rendezvous with a bounded wait, mismatches refused on every rank, and a
fresh process-group generation after a peer dies and comes back, with the surviving rank still usable."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch
from harness import free_port, next_result, run_ranks, start_rank, values


def _session():
    from tp2.settings import read_tp_env
    from tp2.session import TPSession

    return TPSession(read_tp_env())


def _agree_twice(tp_rank, tp_size, seeds):
    from tp2.collectives import all_reduce

    s = _session()
    g1 = s.agree("prompt-a/0", {"prompt": "p", "seed": "1"}, timeout_s=20)
    a = all_reduce(torch.ones(3), g1).tolist()
    g2 = s.agree("prompt-b/0", {"prompt": "p", "seed": seeds[tp_rank]}, timeout_s=20)
    assert g2 is g1 and s.generation == 1  # healthy: no new group
    return a, all_reduce(torch.full((2,), float(tp_rank)), g2).tolist()


def test_agree_forms_one_group_and_reuses_it():
    outs = values(run_ranks(_agree_twice, 2, ["7", "7"]))
    assert outs == [([2.0, 2.0, 2.0], [1.0, 1.0])] * 2


def _mismatch_then_recover(tp_rank, tp_size):
    from tp2.collectives import all_reduce
    from tp2.errors import RankMismatchError

    s = _session()
    try:
        s.agree("prompt-x/0", {"prompt": "p", "seed": str(tp_rank)}, timeout_s=20)
        return "agreed on different seeds?!"
    except RankMismatchError as e:
        msg = str(e)
    g = s.agree("prompt-y/0", {"prompt": "p", "seed": "5"}, timeout_s=20)
    return msg, all_reduce(torch.ones(1), g).item()


def test_mismatch_refused_on_every_rank_then_next_prompt_works():
    for msg, total in values(run_ranks(_mismatch_then_recover, 2)):
        assert "ranks disagree on the prompt 'prompt-x/0': 'seed' (rank 0: 0, rank 1: 1)" in msg
        assert total == 2.0


def _split_mismatch(tp_rank, tp_size):
    from tp2.errors import RankMismatchError
    from tp2.handshake import model_fingerprint

    plan = ["9a347807", "94918c4c"][tp_rank]  # a split changes the plan: its hash says nothing to a user
    try:
        _session().agree("prompt-s/sampler", model_fingerprint(plan, "ckpt", tp_size, [(3, 1), (1, 1)][tp_rank]), timeout_s=20)
        return "agreed on different splits?!"
    except RankMismatchError as e:
        return str(e)


def test_ranks_started_with_different_splits_are_refused_naming_the_split():
    """Issue 39: this was "'plan' (rank 0: 9a347807..., rank 1: 94918c4c...)", never saying "split"."""
    for msg in values(run_ranks(_split_mismatch, 2)):
        assert "ranks were started with different splits" in msg and "split 3:1 on rank 0, even on rank 1" in msg, msg
        assert "'plan'" not in msg and "--split" in msg, msg


def _rank0_waits_alone_then_agrees(tp_rank, tp_size, go):
    from tp2.collectives import all_reduce
    from tp2.errors import PeerLostError

    s = _session()
    if tp_rank == 0:
        t0 = time.monotonic()
        try:
            s.agree("only-rank0/0", {"prompt": "q"}, timeout_s=3)
            return "agreed alone?!"
        except PeerLostError as e:
            first = (str(e), time.monotonic() - t0)
        go.set()
    else:
        go.wait(60)
    g = s.agree("both/0", {"prompt": "q"}, timeout_s=20)
    return first if tp_rank == 0 else None, all_reduce(torch.ones(1), g).item()


def test_prompt_on_one_rank_only_times_out_and_server_stays_usable():
    go = mp.get_context("spawn").Manager().Event()
    outs = values(run_ranks(_rank0_waits_alone_then_agrees, 2, go))
    (msg, secs), total = outs[0]
    assert "[tp2 r0/2] rank(s) 1 did not reach 'only-rank0/0' within 3 s" in msg
    assert secs < 6, secs
    assert total == 2.0 and outs[1][1] == 2.0


def _survivor(tp_rank, tp_size):
    from tp2.collectives import all_reduce
    from tp2.errors import PeerLostError

    s = _session()
    g = s.agree("p1/0", {"prompt": "r"}, timeout_s=30)
    all_reduce(torch.ones(1), g)
    try:
        all_reduce(torch.ones(1), g)  # rank 1 dies instead of joining this one
        return "reduced with a dead peer?!"
    except PeerLostError as e:
        lost = str(e)
        s.abandon_group()  # as a rank does after a broken collective: the next agreement forms a new group
    g = s.agree("p2/0", {"prompt": "r"}, timeout_s=60)  # a restarted rank 1 joins
    return lost, s.generation, all_reduce(torch.full((1,), 3.0), g).item()


def _dies(tp_rank, tp_size):
    from tp2.collectives import all_reduce

    s = _session()
    all_reduce(torch.ones(1), s.agree("p1/0", {"prompt": "r"}, timeout_s=30))
    os._exit(1)


def _restarted(tp_rank, tp_size):
    from tp2.collectives import all_reduce

    s = _session()
    g = s.agree("p2/0", {"prompt": "r"}, timeout_s=60)
    return s.generation, all_reduce(torch.full((1,), 4.0), g).item()


def test_peer_restart_gets_a_new_generation():
    q = mp.get_context("spawn").Queue()
    port = free_port()
    p0 = start_rank(_survivor, 0, 2, port, q, timeout_s=10)
    p1 = start_rank(_dies, 1, 2, port, q, timeout_s=10)
    p1.join(60)
    assert p1.exitcode == 1
    p1b = start_rank(_restarted, 1, 2, port, q, timeout_s=10)
    results = {}
    for _ in range(2):
        r, status, value, _secs = next_result(q)
        assert status == "ok", value
        results[r] = value
    for p in (p0, p1b):
        p.join(30)
    lost, gen, total = results[0]
    assert "all_reduce of (1,) torch.float32 failed: rank 1 ended" in lost, lost
    assert gen == 2 and results[1] == (2, 7.0) and total == 7.0
