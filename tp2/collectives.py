"""TP process groups and the collectives the pack uses, each with a one-line contract and a bounded wait.

Three layers, each talking only to the one below (as in vLLM): `TPGroup` (group state, from env), the
collective functions here, and the parallel layers in `layers.py`. Every collective runs under the group's
timeout; a peer that died or never came surfaces as `PeerLostError` on the surviving rank.

A group may carry `stop_check` (the session's watcher): then every wait on a CPU-side (gloo) collective polls it,
and a peer that stopped the run (its reason) or went silent ends the wait within a poll with
`PromptAbortedError(reason)`, instead of at the timeout. NCCL collectives are queued on the GPU stream, where
the host does not wait; for them the watcher aborts the communicator (see tp2/session.py).

Env: TP2_RANK, TP2_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TP2_TIMEOUT_S (default 300).
Imports torch only; never `comfy`.
"""

from __future__ import annotations

import functools
import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import settings
from .errors import PeerLostError, PromptAbortedError
from .settings import TPEnv

log = logging.getLogger(__name__)

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def reduce_dtype_from_env(environ=None) -> torch.dtype:
    """The dtype row-parallel partial sums are reduced in: fp32 (default, no extra rounding) or bf16 (half the bytes)."""
    return REDUCE_DTYPES[settings.value("TP2_REDUCE_DTYPE", environ)]


@dataclass
class TPGroup:
    """One rank's view of the TP world: its rank, the tensor group (NCCL or gloo) and a gloo CPU group."""

    tp_rank: int
    tp_size: int
    device: torch.device
    group: dist.ProcessGroup | None  # tensor collectives
    cpu_group: dist.ProcessGroup | None  # handshakes and small objects, never blocks a GPU stream
    timeout_s: float
    stop_check: Callable[[], str | None] | None = None  # why the run must stop now (a peer's reason), else None
    loss_check: Callable[[], str | None] | None = None  # after a broken collective: which rank is gone, if known

    @functools.cached_property
    def backend(self) -> str:  # fixed for the group's life; read per collective
        return dist.get_backend(self.group) if self.group is not None else "none"


def init_tp_group(
    env: TPEnv, device: torch.device | None = None, store: dist.Store | None = None, stop_check=None, loss_check=None
) -> TPGroup:
    """Join the TP world (NCCL on CUDA, gloo on CPU, or gloo on CUDA for the benchmarks' one-GPU mode,
    TP2_BENCH_GLOO_ON_CUDA); a peer that never arrives is an error after the timeout.

    With `store`, the group forms over it (a session's generation-prefixed store); otherwise over
    MASTER_ADDR:MASTER_PORT.
    """
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    backend = "nccl" if device.type == "cuda" and not settings.value("TP2_BENCH_GLOO_ON_CUDA") else "gloo"
    timeout = timedelta(seconds=env.timeout_s)
    where = {"store": store} if store is not None else {"init_method": f"tcp://{env.master_addr}:{env.master_port}"}
    try:
        dist.init_process_group(
            backend, rank=env.tp_rank, world_size=env.tp_size, timeout=timeout, device_id=device if backend == "nccl" else None, **where
        )
        cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    except (RuntimeError, dist.DistError) as e:
        raise PeerLostError(
            f"Rank {env.tp_rank} of {env.tp_size} could not form the TP group at {env.master_addr}:{env.master_port} "
            f"within {env.timeout_s:.0f} s ({type(e).__name__}: {e}). Start every rank with the same MASTER_ADDR, "
            "MASTER_PORT and TP2_WORLD_SIZE, and check the other ranks' logs."
        ) from e
    log.info("[tp2 r%d/%d] joined TP group (%s, timeout %.0f s)", env.tp_rank, env.tp_size, backend, env.timeout_s)
    return TPGroup(env.tp_rank, env.tp_size, device, dist.group.WORLD, cpu_group, env.timeout_s, stop_check, loss_check)


REASON_GRACE_S = 2.0  # after a collective fails, how long to look for the peer's published reason


def _lost(tp: TPGroup, op: str, e: BaseException) -> PeerLostError | PromptAbortedError:
    """The error for a failed collective: the peer's own reason when it published one (it stopped the run), else
    the rank known to be gone, else a peer that died."""
    if tp.stop_check is not None:
        deadline = time.monotonic() + REASON_GRACE_S
        while time.monotonic() < deadline:
            why = tp.stop_check()
            if why:
                return PromptAbortedError(why)
            time.sleep(0.05)
    gone = tp.loss_check() if tp.loss_check is not None else None
    if gone:
        return PeerLostError(f"[tp2 r{tp.tp_rank}/{tp.tp_size}] {op} failed: {gone}")
    return PeerLostError(f"[tp2 r{tp.tp_rank}/{tp.tp_size}] {op} failed: {_what_happened(tp, e)} ({type(e).__name__}: {e})")


ENDED = ("closed", "reset by peer", "refused", "broken pipe", "end of file")  # words of a connection whose process ended


def _what_happened(tp: TPGroup, e: BaseException) -> str:
    """What a failed collective says of the peer, from the error itself: with two ranks the peer is the other one."""
    who = f"rank {1 - tp.tp_rank}" if tp.tp_size == 2 else "a peer rank"
    text = str(e).lower()
    if any(word in text for word in ENDED):
        return f"{who} ended: it closed its connection (killed, crashed or out of host memory); the launcher starts it again, read its log"
    if "timeout" in text or "timed out" in text:
        return f"{who} did not answer within {tp.timeout_s:.0f} s: it is frozen or stuck; read its log (scripts/start-tp2.sh status)"
    return f"{who} failed or died; read the other ranks' logs (scripts/start-tp2.sh status)"


def wait(work, tp: TPGroup, what: str | Callable[[], str], host_side: bool) -> None:
    """Wait for `work`; a host-side (gloo) wait polls the group's `stop_check` so a peer's stop ends it at once.

    A GPU (NCCL) work only makes the current stream wait, as before. `what` names the collective in an error (a
    callable is called only then: the hot path formats nothing)."""
    try:
        if not host_side or tp.stop_check is None:
            work.wait()
            return
        pause = 0.0002
        while not work.is_completed():
            why = tp.stop_check()
            if why:
                raise PromptAbortedError(why)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        work.wait()  # raises if the collective failed
    except (RuntimeError, dist.DistError) as e:
        raise _lost(tp, what() if callable(what) else what, e) from e


def _host_side(tp: TPGroup) -> bool:
    return tp.backend == "gloo"


def all_reduce(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Forward: all-reduce(sum) in place over the TP group; identity at tp_size 1."""
    if tp.tp_size == 1:
        return t

    def what() -> str:
        return f"all_reduce of {tuple(t.shape)} {t.dtype}"

    try:
        work = dist.all_reduce(t, group=tp.group, async_op=True)
    except (RuntimeError, dist.DistError) as e:
        raise _lost(tp, what(), e) from e
    wait(work, tp, what, _host_side(tp))
    return t


class Pending:
    """A collective in flight: `result()` makes the current stream wait for it and returns the tensor."""

    def __init__(self, work, finish, tp: TPGroup, what: str):
        self._work, self._finish, self._tp, self._what = work, finish, tp, what

    def result(self) -> torch.Tensor:
        if self._work is not None:
            wait(self._work, self._tp, self._what, _host_side(self._tp))
        return self._finish()


def start_reduce_scatter_rows(t: torch.Tensor, tp: TPGroup, out: torch.Tensor | None = None) -> Pending:
    """Sequence parallelism's reduce, started: sum `t` [S, ...] over ranks, this rank keeps S/tp_size rows (into
    `out`, a contiguous [S/tp_size, ...] tensor or view, when given).

    Moves half the bytes of an all-reduce per rank. S must be a multiple of tp_size (callers pad). gloo has no
    reduce-scatter: there it is an all-reduce and a narrow, with the same sums."""
    what = f"reduce_scatter of {tuple(t.shape)} {t.dtype}"
    if tp.tp_size == 1:
        return Pending(None, lambda: t if out is None else out.copy_(t), tp, what)
    n = t.shape[0] // tp.tp_size
    try:
        if tp.backend == "nccl":
            out = torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device) if out is None else out
            return Pending(dist.reduce_scatter_tensor(out, t.contiguous(), group=tp.group, async_op=True), lambda: out, tp, what)
        work = dist.all_reduce(t, group=tp.group, async_op=True)
    except (RuntimeError, dist.DistError) as e:
        raise _lost(tp, what, e) from e

    def finish() -> torch.Tensor:
        mine = t.narrow(0, tp.tp_rank * n, n)
        return mine.clone() if out is None else out.copy_(mine)

    return Pending(work, finish, tp, what)


def start_all_gather_rows(t: torch.Tensor, tp: TPGroup, out: torch.Tensor | None = None) -> Pending:
    """Every rank's rows `t` [n, ...] stacked in rank order, [tp_size * n, ...] (into `out`, a contiguous tensor or
    view of that shape, when given), started."""
    what = f"all_gather of {tuple(t.shape)} {t.dtype}"
    if tp.tp_size == 1:
        return Pending(None, lambda: t if out is None else out.copy_(t), tp, what)
    if out is None:
        out = torch.empty((t.shape[0] * tp.tp_size, *t.shape[1:]), dtype=t.dtype, device=t.device)
    elif not out.is_contiguous() or out.shape[0] != t.shape[0] * tp.tp_size:
        raise ValueError(f"all_gather into {tuple(out.shape)} (contiguous: {out.is_contiguous()}) for rows {tuple(t.shape)}")
    try:
        if tp.backend == "nccl":
            work = dist.all_gather_into_tensor(out, t.contiguous(), group=tp.group, async_op=True)
        else:
            work = dist.all_gather(list(out.chunk(tp.tp_size)), t.contiguous(), group=tp.group, async_op=True)
    except (RuntimeError, dist.DistError) as e:
        raise _lost(tp, what, e) from e
    return Pending(work, lambda: out, tp, what)


def reduce_scatter_rows(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """`start_reduce_scatter_rows(t, tp).result()`."""
    return start_reduce_scatter_rows(t, tp).result()


def all_gather_rows(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """`start_all_gather_rows(t, tp).result()`."""
    return start_all_gather_rows(t, tp).result()


def _cpu(op, tp: TPGroup, what: str, *args, **kwargs) -> None:
    """One collective on the CPU group, waited for with the stop check."""
    try:
        work = op(*args, group=tp.cpu_group, async_op=True, **kwargs)
    except (RuntimeError, dist.DistError) as e:
        raise _lost(tp, what, e) from e
    wait(work, tp, what, host_side=True)


def broadcast_object(obj: object, tp: TPGroup, src: int = 0) -> object:
    """Rank `src`'s picklable object on every rank (over the CPU group)."""
    if tp.tp_size == 1:
        return obj
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if tp.tp_rank == src else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
    _cpu(dist.broadcast, tp, "broadcast of an object's size", size, src=src)
    data = data if data is not None else torch.empty(int(size.item()), dtype=torch.uint8)
    _cpu(dist.broadcast, tp, f"broadcast of an object ({int(size.item())} bytes)", data, src=src)
    return obj if tp.tp_rank == src else pickle.loads(data.numpy().tobytes())


def all_gather_object(obj: object, tp: TPGroup) -> list:
    """Every rank's picklable object, in rank order (over the CPU group)."""
    if tp.tp_size == 1:
        return [obj]
    mine = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(tp.tp_size)]
    _cpu(dist.all_gather, tp, "all_gather of object sizes", sizes, torch.tensor([mine.numel()], dtype=torch.int64))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: mine.numel()] = mine
    blobs = [torch.empty(longest, dtype=torch.uint8) for _ in range(tp.tp_size)]
    _cpu(dist.all_gather, tp, f"all_gather of objects ({longest} bytes)", blobs, padded)
    return [pickle.loads(b[: int(n.item())].numpy().tobytes()) for b, n in zip(blobs, sizes)]


def _flatten(obj, tensors: list[torch.Tensor]):
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("__tensor__", len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _flatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_flatten(v, tensors) for v in obj)
    return obj


def _unflatten(skel, tensors: list[torch.Tensor]):
    if isinstance(skel, tuple) and len(skel) == 4 and skel[0] == "__tensor__":
        return tensors[skel[1]]
    if isinstance(skel, dict):
        return {k: _unflatten(v, tensors) for k, v in skel.items()}
    if isinstance(skel, (list, tuple)):
        return type(skel)(_unflatten(v, tensors) for v in skel)
    return skel


def carries_tensors(value: object) -> bool:
    """Whether `value` is a tensor or a dict/list/tuple holding one at any depth (what broadcast_tree must carry)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(carries_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(carries_tensors(v) for v in value)
    return False


def broadcast_tree(obj: object, tp: TPGroup, src: int = 0) -> object:
    """Rank `src`'s nested dict/list/tuple of tensors and plain values, identical on every rank.

    The structure, shapes and dtypes go over the CPU group; tensors go over the tensor group on `tp.device`.
    Contract: forward: broadcast from `src`; other ranks' inputs are ignored (pass None).
    """
    if tp.tp_size == 1:
        return obj
    tensors: list[torch.Tensor] = []
    skel = _flatten(obj, tensors) if tp.tp_rank == src else None
    skel = broadcast_object(skel, tp, src)
    if tp.tp_rank != src:
        metas: list = []
        _collect_meta(skel, metas)
        tensors = [torch.empty(shape, dtype=dtype, device=tp.device) for shape, dtype in metas]
    else:
        tensors = [t.to(tp.device).contiguous() for t in tensors]
    what = f"broadcast of {len(tensors)} tensors"
    try:
        works = [dist.broadcast(t, src=src, group=tp.group, async_op=True) for t in tensors]
    except (RuntimeError, dist.DistError) as e:
        raise _lost(tp, what, e) from e
    for work in works:
        wait(work, tp, what, _host_side(tp))
    return _unflatten(skel, tensors)


def _collect_meta(skel, out: list) -> None:
    if isinstance(skel, tuple) and len(skel) == 4 and skel[0] == "__tensor__":
        out.append((skel[2], skel[3]))
    elif isinstance(skel, dict):
        for v in skel.values():
            _collect_meta(v, out)
    elif isinstance(skel, (list, tuple)):
        for v in skel:
            _collect_meta(v, out)
