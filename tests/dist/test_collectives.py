"""Handshake, broadcast and failure behaviour on real gloo process groups: mismatches and dead peers are errors
on every surviving rank within the configured timeout, never hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
from harness import run_ranks, values


def _join():
    from tp2.collectives import init_tp_group
    from tp2.settings import read_tp_env

    return init_tp_group(read_tp_env())


def _handshake_worker(tp_rank, tp_size, checkpoint_by_rank):
    from harness import handshake
    from tp2.handshake import model_fingerprint

    tp = _join()
    handshake(tp, model_fingerprint("plan-a", checkpoint_by_rank[tp_rank], tp_size))
    return "agreed"


@pytest.mark.parametrize("tp_size", [2, 4])
def test_handshake_agrees(tp_size):
    assert values(run_ranks(_handshake_worker, tp_size, ["ckpt-1"] * tp_size)) == ["agreed"] * tp_size


def test_handshake_mismatch_raises_on_every_rank():
    results = run_ranks(_handshake_worker, 2, ["ckpt-1", "ckpt-2"])
    for r in (0, 1):
        status, (kind, msg, _), _ = results[r]
        assert status == "error" and kind == "RankMismatchError", results[r]
        assert f"[tp2 r{r}/2] ranks disagree on the model: 'checkpoint' (rank 0: ckpt-1, rank 1: ckpt-2)" in msg


def _broadcast_worker(tp_rank, tp_size):
    from tp2.collectives import all_reduce, broadcast_tree

    tp = _join()
    mine = {"x": [torch.full((2, 3), float(tp_rank)), torch.arange(4)], "t": torch.tensor([tp_rank * 1.5]), "name": f"r{tp_rank}", "n": None}
    got = broadcast_tree(mine if tp_rank == 0 else None, tp)
    summed = all_reduce(torch.full((5,), float(tp_rank + 1)), tp)
    return got, summed


def test_broadcast_tree_and_all_reduce():
    outs = values(run_ranks(_broadcast_worker, 4))
    for got, summed in outs:
        assert got["name"] == "r0" and got["n"] is None
        assert torch.equal(got["x"][0], torch.zeros(2, 3)) and torch.equal(got["x"][1], torch.arange(4))
        assert got["t"].item() == 0.0
        assert torch.equal(summed, torch.full((5,), 10.0))


def _sequence_parallel_worker(tp_rank, tp_size):
    from tp2.collectives import all_reduce, start_all_gather_rows, start_reduce_scatter_rows

    tp = _join()
    g = torch.Generator().manual_seed(tp_rank)
    partial = torch.randn(4 * tp_size, 3, generator=g)  # this rank's partial sums of a [4 * tp_size, 3] output
    mine = start_reduce_scatter_rows(partial.clone(), tp).result()
    whole = start_all_gather_rows(mine, tp).result()
    # several in flight at once, waited in order (the pipelined MLP's pattern)
    pending = [start_all_gather_rows(mine[:2].clone(), tp), start_all_gather_rows(mine[2:].clone(), tp)]
    pending.append(start_reduce_scatter_rows(partial.clone(), tp))
    halves, again = [p.result() for p in pending[:2]], pending[2].result()
    assert torch.equal(again, mine)
    assert torch.equal(torch.cat([h.view(tp_size, 2, 3) for h in halves], dim=1).reshape(-1, 3), whole)
    return mine, whole, all_reduce(partial.clone(), tp)


@pytest.mark.parametrize("tp_size", [2, 3])
def test_reduce_scatter_then_all_gather_is_all_reduce(tp_size):
    """Sequence parallelism's pattern: each rank's rows of the sum, then every rank has all rows, equal to one all-reduce."""
    outs = values(run_ranks(_sequence_parallel_worker, tp_size))
    summed = outs[0][2]
    for r, (mine, whole, reduced) in enumerate(outs):
        assert mine.shape == (4, 3) and torch.equal(mine, summed[4 * r : 4 * r + 4])
        assert torch.equal(whole, summed) and torch.equal(reduced, summed)


def _dies_after_handshake(tp_rank, tp_size):
    from tp2.collectives import all_reduce
    from harness import handshake

    tp = _join()
    handshake(tp, {"plan": "p"})
    if tp_rank == 1:
        os._exit(3)  # a crashed ComfyUI: no goodbye
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        all_reduce(torch.ones(1000), tp)
    finally:
        print(f"survivor waited {time.monotonic() - t0:.1f} s")
    return "reduced with a dead peer?!"


def test_dead_peer_is_an_error_within_the_timeout():
    t0 = time.monotonic()
    results = run_ranks(_dies_after_handshake, 2, timeout_s=10, wall_s=90)
    status, err, secs = results[0]
    assert status == "error" and err[0] == "PeerLostError", results[0]
    assert "[tp2 r0/2] all_reduce of (1000,) torch.float32 failed: rank 1 ended: it closed its connection" in err[1], err[1]
    assert secs < 10 + 15, secs  # start-up + handshake + at most the timeout
    assert time.monotonic() - t0 < 60


def _alone(tp_rank, tp_size):
    _join()
    return "joined a world of 2 alone?!"


def test_peer_that_never_arrives_is_an_error_within_the_timeout():
    results = run_ranks(_alone, 2, ranks=[0], timeout_s=5, wall_s=90)
    status, err, secs = results[0]
    assert status == "error" and err[0] == "PeerLostError", results[0]
    assert "Rank 0 of 2 could not form the TP group at 127.0.0.1:" in err[1] and "within 5 s" in err[1]
    assert secs < 5 + 20, secs


def _sequence_worker(tp_rank, tp_size, full):
    from tp2.collectives import start_all_gather_rows, start_reduce_scatter_rows
    from tp2.sequence_layout import RowLayout

    tp = _join()
    x = torch.arange(full * 3, dtype=torch.float32).reshape(full, 3) + 1
    layout = RowLayout.plan(full, tp_size, tp_rank)
    local = layout.take(x)
    gathered = start_all_gather_rows(local, tp).result()
    summed = start_reduce_scatter_rows(layout.pad(x * (tp_rank + 1)), tp).result()
    return gathered, summed, local


@pytest.mark.parametrize("tp_size,full", [(2, 37), (3, 20), (2, 3), (3, 2)])
def test_sequence_gathers_and_reduces(tp_size, full):
    """tp2.sequence_layout on gloo: an all-gather of the ranks' rows rebuilds the sequence (pad rows zero), and the
    reduce-scatter of a partial output of the real rows leaves each rank the sums of its own rows."""
    x = torch.arange(full * 3, dtype=torch.float32).reshape(full, 3) + 1
    total = sum(r + 1 for r in range(tp_size))
    for gathered, summed, local in values(run_ranks(_sequence_worker, tp_size, full)):
        assert torch.equal(gathered[:full], x) and not gathered[full:].any()
        assert torch.equal(summed, local * total)


def _same_everywhere_worker(tp_rank, tp_size):
    import torch

    from tp2.collectives import init_tp_group
    from tp2.same_bytes import bytes_digest, same_everywhere
    from tp2.settings import read_tp_env

    tp = init_tp_group(read_tp_env())
    out = []
    for case in ("equal", "one rank off", "strided"):
        base = torch.randn(1, 3, 5, 8, 4, generator=torch.Generator().manual_seed(0))
        t = base.movedim(1, -1)  # as ComfyUI's VAE.decode returns its frames: not contiguous
        if case == "strided":
            t = base[:, :, ::2]  # no dense dim order: compared and copied through a contiguous copy
        if case != "equal" and tp_rank == tp_size - 1:  # the last rank rounds a few values differently
            flat = base.view(-1)[::97]  # element 0 is in both views
            base.view(-1)[::97] = torch.nextafter(flat, torch.full_like(flat, float("inf")))
        differ = same_everywhere(t, tp, piece_bytes=1000)  # many pieces
        out.append((case, differ, bytes_digest(t)))
    return out


def test_same_everywhere_makes_every_rank_take_rank0s_bytes_only_where_they_differ():
    outs = values(run_ranks(_same_everywhere_worker, 3))
    for i, case in enumerate(("equal", "one rank off", "strided")):
        differ = [o[i][1] for o in outs]
        assert differ == ([[]] * 3 if case == "equal" else [[2]] * 3), (case, differ)
        assert len({o[i][2] for o in outs}) == 1, f"{case}: the ranks' bytes differ after same_everywhere"


def _model_input_worker(tp_rank, tp_size):
    """The pack's DIFFUSION_MODEL pattern: every rank hands its own inputs to broadcast_tree and runs on what comes
    back; then a wrapper inside changes the model input in place, as EasyCache's skipped step does (`x += diff`)."""
    from tp2.collectives import broadcast_tree

    tp = _join()
    packed = torch.randn(1, 1, 40, generator=torch.Generator().manual_seed(0))  # the sampler's model input, alike everywhere
    x = [packed[..., :24].reshape(1, 24, 1), packed[..., 24:].reshape(1, 16, 1)]  # ComfyUI's unpack_latents: views of it
    transposed = torch.arange(24.0).reshape(4, 6).t()  # not contiguous: rank 0 sends a copy, so nobody keeps their own
    got = broadcast_tree({"x": list(x), "t": torch.tensor([0.5 + tp_rank]), "transposed": transposed, "n": tp_rank}, tp)
    got["x"][0] += 1.0
    return packed, got["t"], got["x"][0] is x[0], got["transposed"] is transposed, got["n"]


def test_broadcast_tree_hands_on_by_reference_alike_on_every_rank():
    """Rank 0 passes its contiguous inputs on by reference, so an in-place change downstream reaches its own tensors
    (ComfyUI's denoise reads that model input): every rank receives rank 0's values into its own tensors, and the
    change lands alike. Before, the others received copies and rank 1's latent left rank 0's (issue 50)."""
    outs = values(run_ranks(_model_input_worker, 3))
    want = torch.randn(1, 1, 40, generator=torch.Generator().manual_seed(0))
    want[..., :24] += 1.0
    for packed, t, x_is_own, transposed_is_own, n in outs:
        assert torch.equal(packed, want) and torch.equal(t, torch.tensor([0.5])) and n == 0
        assert x_is_own and not transposed_is_own


def _layouts_worker(tp_rank, tp_size):
    from tp2.same_bytes import bytes_digest, same_everywhere

    tp = _join()
    values_ = torch.randn(2, 5, 6, 3, generator=torch.Generator().manual_seed(1))
    # the same values, each rank in its own memory layout: row-major, channels first then moved last, a strided view
    t = [values_.clone(), values_.movedim(-1, 1).contiguous().movedim(1, -1), torch.zeros(2, 5, 12, 3)[:, :, ::2]][tp_rank]
    if tp_rank == 2:
        t.copy_(values_)
    digest = bytes_digest(t)
    if tp_rank > 0:  # ranks 1 and 2 round one value differently
        t[1, 2, 3, 1] = torch.nextafter(t[1, 2, 3, 1], torch.tensor(float("inf")))
    differ = same_everywhere(t, tp, piece_bytes=40)  # many pieces, each fewer bytes than one row
    return digest, differ, t.clone()


def test_equal_values_digest_alike_and_are_made_same_whatever_the_strides():
    """bytes_digest hashes the values in row-major order, not the memory: equal tensors in three layouts digest alike
    (memory order gave three digests); same_everywhere then copies rank 0's values into every layout, element for
    element (a copy in memory order would scramble a rank whose layout differs)."""
    outs = values(run_ranks(_layouts_worker, 3))
    assert len({digest for digest, _, _ in outs}) == 1
    want = torch.randn(2, 5, 6, 3, generator=torch.Generator().manual_seed(1))
    for _, differ, t in outs:
        assert differ == [1, 2] and torch.equal(t, want)


def test_bytes_digest_tells_bit_patterns_apart():
    """Equal values, other bits: -0.0 and 0.0 (and a dtype) digest differently, since the files they make differ."""
    from tp2.same_bytes import bytes_digest

    zeros = torch.zeros(3, 4)
    assert bytes_digest(zeros) == bytes_digest(torch.zeros(4, 3).t().contiguous().t())
    assert bytes_digest(zeros) != bytes_digest(-zeros) and bytes_digest(zeros) != bytes_digest(zeros.double())
