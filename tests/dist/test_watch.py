"""A rank's stop reaches every rank in seconds, on real gloo groups (2 and 4 ranks): a peer waiting in a collective
or at a rendezvous leaves with the stopping rank's own reason; a silent peer is named by its heartbeat; a stop
notice that no rank signed is never shown; rendezvous keys are gone after agreement."""

from __future__ import annotations

import time

import pytest
import torch
from harness import run_ranks, values

SECRET = "s" * 64


def _session(secret=SECRET, heartbeat_timeout_s=None):
    import uuid

    from tp2.settings import read_tp_env
    from tp2.session import TPSession

    s = TPSession(read_tp_env(), boot_id=uuid.uuid4().hex, secret=secret)
    if heartbeat_timeout_s is not None:
        s.watcher.heartbeat_timeout_s = heartbeat_timeout_s
    s.agree("warm-up", {"x": "1"}, timeout_s=30)  # rank 0's store is up: the watchers can start
    s.watcher.start()
    return s


def _stop_in_a_collective(tp_rank, tp_size, stopper):
    from tp2.collectives import all_reduce
    from tp2.errors import PromptAbortedError

    s = _session()
    s.watcher.begin("run-1")
    g = s.agree("run-1/sampler1", {"seed": "1"}, timeout_s=30)
    all_reduce(torch.ones(2), g)  # every rank is in the group
    message, waited = "stopped", 0.0
    if tp_rank == stopper:
        time.sleep(1.0)  # the others are waiting in the next all_reduce by now
        s.stop_run(f"rank {tp_rank} ran out of GPU memory at step 4 of 8 (CUDA out of memory): use fewer frames")
    else:
        t0 = time.monotonic()
        try:
            all_reduce(torch.ones(2), g)
            return "completed?!"
        except PromptAbortedError as e:
            message, waited = str(e), time.monotonic() - t0
            s.abandon_group()
    s.watcher.end()
    s.watcher.begin("run-2")  # the next run forms a new group, and it works
    g2 = s.agree("run-2/sampler1", {"seed": "2"}, timeout_s=30)
    return message, waited, all_reduce(torch.ones(1), g2).item(), s.generation


@pytest.mark.parametrize("tp_size,stopper", [(2, 1), (4, 2)])
def test_a_rank_that_stops_releases_every_peer_from_its_collective_with_its_reason(tp_size, stopper):
    out = run_ranks(_stop_in_a_collective, tp_size, stopper, timeout_s=120)
    for r, v in enumerate(values(out)):
        if r == stopper:
            continue
        message, waited, total, generation = v
        assert f"rank {stopper} ran out of GPU memory at step 4 of 8" in message, message
        assert waited < 5.0, waited  # not the 120 s collective timeout
    assert all(v[2] == float(tp_size) and v[3] == 2 for v in values(out)), values(out)


def _silent_peer(tp_rank, tp_size):
    from tp2.collectives import all_reduce
    from tp2.errors import PromptAbortedError

    s = _session(heartbeat_timeout_s=3.0)
    s.watcher.begin("run-1")
    g = s.agree("run-1/sampler1", {"seed": "1"}, timeout_s=30)
    if tp_rank == 1:
        s.watcher._thread = None  # noqa: SLF001 - simulate a frozen process: its heartbeats stop...
        s.watcher.poll = lambda: None  # ...for good
        time.sleep(12)
        return "slept"
    t0 = time.monotonic()
    try:
        all_reduce(torch.ones(2), g)
        return "completed?!"
    except PromptAbortedError as e:
        return str(e), time.monotonic() - t0


def test_a_silent_peer_is_named_by_its_heartbeat():
    out = values(run_ranks(_silent_peer, 2, timeout_s=120))
    message, waited = out[0]
    assert "rank 1 is not responding (no heartbeat for" in message, message
    assert waited < 8.0, waited


def _unsigned_notice(tp_rank, tp_size):
    import json

    from tp2.collectives import all_reduce
    from tp2.errors import PromptAbortedError

    s = _session()
    s.watcher.begin("run-u")
    if tp_rank == 0:  # an outsider writes a notice without the secret
        s._connect(10).set("tp2/run/run-u/stop", json.dumps({"rank": 1, "reason": "Your licence has expired"}))
    time.sleep(2.0)
    unsigned = s.watcher.stop_reason
    try:
        g = s.agree("run-u/sampler1", {"seed": "1"}, timeout_s=30)
        agreed = all_reduce(torch.ones(1), g).item() == tp_size  # also: neither rank leaves (ending the store) early
    except PromptAbortedError:
        agreed = False
    return unsigned, agreed


def test_a_stop_notice_no_rank_signed_is_ignored():
    for unsigned, agreed in values(run_ranks(_unsigned_notice, 2, timeout_s=60)):
        assert unsigned is None and agreed


def _keys_after(tp_rank, tp_size):
    from tp2.collectives import all_reduce

    s = _session()
    s.watcher.begin("run-k")
    g = s.agree("run-k/sampler1", {"seed": "1"}, timeout_s=30)
    time.sleep(1.0)
    store = s._connect(10)
    present = [store.check([f"tp2/rv/run-k/sampler1/rank{r}"]) for r in range(tp_size)] + [store.check(["tp2/rv/run-k/sampler1/read"])]
    all_reduce(torch.ones(1), g)  # rank 0 (the store) stays until every rank has looked
    return present


def test_rendezvous_keys_are_deleted_after_agreement():
    for present in values(run_ranks(_keys_after, 2, timeout_s=60)):
        assert not any(present), present


def _stop_seen_when_all_arrived(tp_rank, tp_size):
    from tp2.errors import PromptAbortedError

    s = _session()
    s.watcher.begin("run-a")
    if tp_rank == 0:
        s.stop_run("interrupted on rank 0")
        time.sleep(1.5)
    else:
        time.sleep(1.5)  # arrives after the stop; rank 0's arrival key may or may not be there
    t0 = time.monotonic()
    try:
        s.agree("run-a/sampler1", {"seed": "1"}, timeout_s=30)
        return "agreed?!", 0
    except PromptAbortedError as e:
        return str(e), time.monotonic() - t0


def test_a_rank_arriving_after_a_stop_leaves_at_once():
    out = values(run_ranks(_stop_seen_when_all_arrived, 2, timeout_s=60))
    assert "interrupted on rank 0" in out[1][0] and out[1][1] < 2.0, out[1]
    assert "interrupted on rank 0" in out[0][0], out[0]


def test_failure_messages_name_the_rank_and_say_what_to_do():
    from tp2.signing import signed
    from tp2.watch import Watcher, describe_failure, with_advice

    oom = describe_failure(1, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 4, 8)
    assert oom == (
        "rank 1 ran out of GPU memory at step 4 of 8 (CUDA out of memory. Tried to allocate 2.00 GiB): "
        "use fewer frames, a lower resolution or more ranks"
    )
    assert describe_failure(0, ValueError("bad"), None, None) == "rank 0 failed: ValueError: bad"
    torch_oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. " + "x" * 400)  # as long as torch's
    told = with_advice(torch_oom, "at 1920x1088 up to 175 frames fit")
    assert type(told) is torch.OutOfMemoryError and str(told).startswith("out of GPU memory; at 1920x1088 up to 175 frames fit. ")
    assert "up to 175 frames fit" in describe_failure(1, told, 4, 8)  # the advice survives the cut
    assert with_advice(torch_oom, None) is torch_oom and with_advice(ValueError("bad"), "advice").args == ("bad",)
    watcher, plain = Watcher(0, 2, "127.0.0.1", 1, "boot", SECRET), '{"rank": 1, "reason": "x"}'
    good = signed(SECRET, "tp2/run/run/stop", plain)
    assert watcher._notice("run", good) == (1, "x")
    assert watcher._notice("other-run", good) is None  # a notice is bound to its run
    assert watcher._notice("run", plain) is None
    assert Watcher(0, 2, "127.0.0.1", 1, "boot")._notice("run", plain) == (1, "x")  # no secret: no front door either


def test_nccl_decisions():
    from tp2.settings import set_for_libraries

    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert set_for_libraries(cuda=True, loopback=False, environ=env) == "3" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    env = {}
    assert set_for_libraries(cuda=True, loopback=False, environ=env) is None and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def _store_sockets(tp_rank, tp_size):
    import os
    import subprocess

    s = _session()
    port = int(os.environ["MASTER_PORT"])
    lines = [ln.split()[3] for ln in subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout.splitlines()[1:]]
    return sorted(addr for addr in lines if addr.rsplit(":", 1)[-1] == str(port)), os.environ.get("GLOO_SOCKET_IFNAME"), s.generation


def test_the_store_listens_on_loopback_only():
    for listening, ifname, generation in values(run_ranks(_store_sockets, 2, timeout_s=60)):
        assert listening == ["127.0.0.1:" + listening[0].rsplit(":", 1)[1]], listening  # not *:PORT
        assert ifname == "lo" and generation == 1


def _keys_over_prompts(tp_rank, tp_size):
    import torch.distributed as dist

    s = _session()
    counts = []
    for i in range(20):
        run = f"run-{i}"
        s.watcher.begin(run)
        s.agree(f"{run}/sampler1", {"seed": "1"}, timeout_s=30)  # both ranks have begun this run, ended the last
        if tp_rank == 0:
            store = dist.TCPStore("127.0.0.1", s.env.master_port, is_master=False, wait_for_workers=False)
            counts.append(store.num_keys())
        if i % 5 == 4 and tp_rank == 1:
            s.stop_run("a failed prompt leaves a stop notice")  # its key goes too
        s.watcher.end()
    return counts


def test_the_store_does_not_grow_with_the_prompts():
    counts = values(run_ranks(_keys_over_prompts, 2, timeout_s=60))[0]
    # bounded by the keys of two runs, a rendezvous in flight and a stop notice; kept for good, 2 keys a prompt
    # would have added 38 over these 20
    assert max(counts) < counts[0] + 12, counts


def _forgery(tp_rank, tp_size):
    import torch.distributed as dist

    s = _session()
    s.watcher.begin("run-f")
    if tp_rank == 1:
        s.cache_epoch(bump=True)  # a failed step: every rank clears its node cache before the next prompt
    s.agree("run-f/sampler1", {"seed": "1"}, timeout_s=30)
    signed_epoch = s.cache_epoch()
    s.agree("run-f/read-signed", {"x": "1"}, timeout_s=30)  # both read the signed epoch before the forgery is written
    if tp_rank == 0:  # a local process that knows the store's address but not the secret
        forger = dist.TCPStore("127.0.0.1", s.env.master_port, is_master=False, wait_for_workers=False)
        forger.set("tp2/cache_epoch", "999")  # would read as a failure since every rank's last prompt
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            forger.set("tp2/hb/rank1", "a-restarted-rank:1")  # would read as rank 1 restarted mid-prompt
            time.sleep(0.05)
    else:
        time.sleep(3.5)
    stopped = s.watcher.stop_reason
    if tp_rank == 0:  # rank 1 waits here with its record written; the forger replaces it before rank 0 arrives
        time.sleep(0.5)
        forger.set("tp2/rv/run-f/forged/rank1", '{"x": "text the forger wants compared"}')
    met = s.agree("run-f/forged", {"x": "1"}, timeout_s=30) and "agreed"
    forged_epoch = s.cache_epoch()
    s.agree("run-f/read", {"x": "1"}, timeout_s=30)
    bumped = s.cache_epoch(bump=True) if tp_rank == 1 else None  # a rank's raise writes over the forgery
    s.agree("run-f/end", {"x": "1"}, timeout_s=30)
    return stopped, met, (signed_epoch, forged_epoch, bumped, s.cache_epoch())


def test_a_forged_heartbeat_rendezvous_record_or_cache_epoch_changes_nothing():
    """A forged heartbeat is ignored; a forged rendezvous record is ignored and its rank writes its own again (it
    failed every prompt before, issue 39); a forged cache epoch reads as a raise (every rank clears its node cache:
    an epoch overwritten after /free lost a prompt while it was ignored) and is written over, signed."""
    out = values(run_ranks(_forgery, 2, timeout_s=60))
    for stopped, met, _ in out:
        assert stopped is None, stopped  # the forged heartbeat did not stop the run
        assert met == "agreed", met
    assert [epochs[0] for _, _, epochs in out] == [1, 1] and all(epochs[1] >= 2 for _, _, epochs in out), out
    final = max(out[0][2][1], out[1][2][1]) + 1  # rank 1's signed raise counts from the last
    assert out[1][2][2] == final and out[0][2][3] == out[1][2][3] == final, out


def test_a_peer_whose_port_refuses_is_gone_and_one_that_only_listens_is_not():
    """The evidence that a quiet peer ended: its HTTP port refuses connections. A frozen process's listening socket
    still completes connections in the kernel, so a socket that listens and never accepts is not taken for gone."""
    import socket

    from tp2.watch import Watcher

    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)  # never accepted: as a SIGSTOPped ComfyUI's port
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    gone_port = closed.getsockname()[1]
    closed.close()  # nothing listens there: as a killed rank's port
    urls = ["http://127.0.0.1:1", f"http://127.0.0.1:{frozen.getsockname()[1]}", f"http://127.0.0.1:{gone_port}"]
    w = Watcher(0, 3, "127.0.0.1", 1, "boot", SECRET, peer_urls=urls)
    try:
        assert not w._process_gone(1) and w._process_gone(2)
        assert not Watcher(0, 3, "127.0.0.1", 1, "boot", SECRET)._process_gone(2)  # no addresses: no evidence
    finally:
        frozen.close()


def test_a_peer_is_stuck_only_when_behind_in_this_step_for_longer_than_the_step_allows():
    """The progress timeout is the step's own: STUCK_FACTOR times this rank's longest span between marks (the floor
    under it); a peer in another step, level with this rank, or behind for less than that, is not stuck."""
    from tp2.progress import STUCK_FACTOR, STUCK_FLOOR_S, Progress

    p = Progress()
    p.begin("run-1/vae-decode1")
    assert p.stuck(1, "run-1/vae-decode1#0", time.monotonic() + 1e6) is None  # nothing marked: nothing to wait for
    p.mark()
    span = STUCK_FLOOR_S / STUCK_FACTOR + 1.0  # a unit slow enough that the bound is the step's, not the floor
    p._at = (p._at[0], p._at[1], p._at[2] - span, 0.0)  # noqa: SLF001 - the unit began `span` s ago
    p.mark()
    bound, marked = p.timeout_s(), p._at[2]  # noqa: SLF001
    assert bound == STUCK_FACTOR * p._at[3] and bound > STUCK_FLOOR_S and p._at[3] >= span  # noqa: SLF001
    assert p.stuck(1, "run-1/vae-decode1#1", marked + bound - 0.5) is None  # within the bound
    assert p.stuck(1, "run-1/vae-decode1#2", marked + bound + 1) is None  # level with this rank: no wait on it
    assert p.stuck(1, "run-1/sampler1#0", marked + bound + 1) is None  # another step (or another run's)
    why = p.stuck(1, "run-1/vae-decode1#1", marked + bound + 1)
    assert why is not None and why.startswith("rank 1 is stuck in vae-decode1") and f"progress timeout {bound:.0f} s" in why
    p.end()
    assert p.stuck(1, "run-1/vae-decode1#1", marked + bound + 1) is None and p.token().startswith("#0.")
