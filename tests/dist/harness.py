"""Run a function on N spawned ranks with a real torch.distributed world (gloo on CPU) and collect results.

Each rank gets TP2_RANK/TP2_WORLD_SIZE/MASTER_* in its env and returns a picklable value, or an error record
(type name, message, seconds since start) so tests can assert on what every rank raised and when.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import time
import traceback

from conftest import free_port  # noqa: F401 - the tests import free_port from here


def _entry(target, tp_rank, tp_size, port, timeout_s, queue, args):
    os.environ.update(
        {"TP2_RANK": str(tp_rank), "TP2_WORLD_SIZE": str(tp_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TP2_TIMEOUT_S": str(timeout_s)}
    )
    t0 = time.monotonic()
    try:
        # plain pickle copies tensor data; torch's ForkingPickler would pass shared memory that dies with this process
        queue.put(pickle.dumps((tp_rank, "ok", target(tp_rank, tp_size, *args), time.monotonic() - t0)))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        queue.put(pickle.dumps((tp_rank, "error", (type(e).__name__, str(e), traceback.format_exc()), time.monotonic() - t0)))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def start_rank(target, tp_rank: int, tp_size: int, port: int, queue, *args, timeout_s: float = 60.0):
    """Start one rank process (for tests that kill and restart ranks); results arrive pickled on `queue`."""
    p = mp.get_context("spawn").Process(target=_entry, args=(target, tp_rank, tp_size, port, timeout_s, queue, args), daemon=True)
    p.start()
    return p


def next_result(queue, wait_s: float = 120.0):
    """The next (tp_rank, status, value, seconds) a rank reported."""
    return pickle.loads(queue.get(timeout=wait_s))


def run_ranks(target, tp_size: int, *args, ranks=None, timeout_s: float = 60.0, wall_s: float = 240.0) -> dict:
    """Start `ranks` (default all) of a `tp_size` world running `target(tp_rank, tp_size, *args)`.

    Returns {tp_rank: (status, value, seconds)}; a rank still running after `wall_s` is ("hang", None, wall_s), one
    that exited without reporting is ("died", exit code, seconds until the world ended).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    ranks = list(range(tp_size)) if ranks is None else ranks
    procs = [ctx.Process(target=_entry, args=(target, r, tp_size, port, timeout_s, queue, args), daemon=True) for r in ranks]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + wall_s
    while len(results) < len(ranks) and time.monotonic() < deadline:
        try:
            r, status, value, secs = pickle.loads(queue.get(timeout=0.5))
            results[r] = (status, value, secs)
        except queue_mod.Empty:  # also notice ranks that died without reporting
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    waited = time.monotonic() - (deadline - wall_s)
    for r, p in zip(ranks, procs):
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            results.setdefault(r, ("hang", None, wall_s))
        else:  # exited without reporting: killed (e.g. by NCCL's watchdog) or crashed
            results.setdefault(r, ("died", p.exitcode, waited))
    return results


def values(results: dict) -> list:
    """The ranks' return values in rank order; fails with every rank's error if any rank did not succeed."""
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, "\n".join(f"rank {r}: {v[0]} {v[1][0] if v[1] else ''}: {v[1][2] if v[1] else ''}" for r, v in bad.items())
    return [results[r][1] for r in sorted(results)]


def handshake(tp, fields: dict[str, str], what: str = "model") -> None:
    """Compare `fields` across the ranks of `tp` over its CPU group: RankMismatchError on every rank if any differs."""
    from tp2.collectives import all_gather_object
    from tp2.handshake import compare_fields

    compare_fields(all_gather_object(dict(fields), tp), f"[tp2 r{tp.tp_rank}/{tp.tp_size}]", what)
