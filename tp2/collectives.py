"""TP process groups and the collectives the pack uses, each with a bounded wait.

Every collective runs under the group's timeout; a peer that died or never came surfaces as `PeerLostError` on the
surviving rank. A group may carry the session's watcher (tp2/watch.py): every wait on a CPU-side (gloo) collective
polls it, so a peer that stopped the run (its reason) or went silent ends the wait within a poll with
`PromptAbortedError(reason)`, not at the timeout. NCCL collectives are queued on the GPU stream, where the host does
not wait; for them the watcher aborts the communicator (tp2/session.py). Imports torch only; never `comfy`.
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
from .watch import Watcher

log = logging.getLogger(__name__)


@dataclass
class TPGroup:
    tp_rank: int
    tp_size: int
    device: torch.device
    group: dist.ProcessGroup  # tensor collectives
    cpu_group: dist.ProcessGroup  # handshakes and small objects, never blocks a GPU stream
    timeout_s: float
    watcher: Watcher | None = None  # its stop_reason ends waits; store_problem() names a rank gone; progress is told of waits

    @functools.cached_property
    def backend(self) -> str:  # fixed for the group's life; read per collective
        return dist.get_backend(self.group)

    @functools.cached_property
    def overlap(self) -> int:  # chunks of the row-parallel reduce, as overlap_chunks says for this group
        return overlap_chunks(self.tp_size, self.backend)

    @functools.cached_property
    def wire(self) -> str:  # TP2_WIRE (tp2/wire.py), checked against tp_size as a rank activates
        return settings.value("TP2_WIRE")


def overlap_chunks(tp_size: int, backend: str) -> int:
    """TP2_OVERLAP's chunks of rows (1: off), at 2 ranks only; unset: 4 where NCCL reduces, else off."""
    chunks = settings.value("TP2_OVERLAP")
    return 1 if tp_size != 2 else max(1, chunks) if chunks is not None else 4 if backend == "nccl" else 1


def group_backend(device: torch.device) -> str:
    """NCCL on CUDA, gloo on the CPU (the benchmarks' one-GPU mode replaces this: NCCL refuses two ranks on one GPU)."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_tp_group(
    env: TPEnv, device: torch.device | None = None, store: dist.Store | None = None, watcher: Watcher | None = None
) -> TPGroup:
    """Join the TP world (group_backend(device)) over `store` (a session's generation-prefixed store), else over
    MASTER_ADDR:MASTER_PORT; a peer that never arrives is an error after the timeout."""
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    backend = group_backend(device)
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
    return TPGroup(env.tp_rank, env.tp_size, device, dist.group.WORLD, cpu_group, env.timeout_s, watcher)


REASON_GRACE_S = 2.0  # after a collective fails, how long to look for the peer's published reason
ENDED = ("closed", "reset by peer", "refused", "broken pipe", "end of file")  # words of a connection whose process ended


def _lost(tp: TPGroup, op: str, e: BaseException) -> PeerLostError | PromptAbortedError:
    """The error for a failed collective: the peer's own reason when it published one (it stopped the run), else
    the rank known to be gone, else what the error itself says of the peer (with two ranks, the other one)."""
    deadline = time.monotonic() + REASON_GRACE_S
    while tp.watcher is not None and time.monotonic() < deadline:
        why = tp.watcher.stop_reason
        if why:
            return PromptAbortedError(why)
        time.sleep(0.05)
    who = f"rank {1 - tp.tp_rank}" if tp.tp_size == 2 else "a peer rank"
    text = str(e).lower()
    if any(word in text for word in ENDED):
        why = tp.watcher.why_ended() if tp.watcher is not None else "killed, crashed or out of host memory"
        happened = f"{who} ended: it closed its connection ({why}); the launcher restarts it, read its log"
    elif "timeout" in text or "timed out" in text:
        happened = f"{who} did not answer within {tp.timeout_s:.0f} s: it is frozen or stuck; read its log (scripts/start-tp2.sh status)"
    else:
        happened = f"{who} failed or died; read the other ranks' logs (scripts/start-tp2.sh status)"
    gone = tp.watcher.store_problem() if tp.watcher is not None else None
    told = gone or f"{happened} ({type(e).__name__}: {e})"
    return PeerLostError(f"[tp2 r{tp.tp_rank}/{tp.tp_size}] {op} failed: {told}")


def all_reduce(t: torch.Tensor, tp: TPGroup, wait: bool = True):
    """Forward: all-reduce(sum) in place over the TP group; identity at tp_size 1. `wait=False`: the Pending, started."""

    def what() -> str:
        return f"all_reduce of {tuple(t.shape)} {t.dtype}"

    start = (lambda: dist.all_reduce(t, group=tp.group, async_op=True)) if tp.tp_size > 1 else None
    pending = Pending(tp, what, start, lambda: t)
    return pending.result() if wait else pending


class Pending:
    """A collective in flight, started by `start()` (None: nothing to wait for; one that cannot even start is the loss
    of a peer): `result()` waits for it and returns `finish()`. A host-side wait (by default on a gloo group) polls the
    group's watcher so a peer's stop ends it at once; a GPU one only makes the current stream wait. `what` names the
    collective in an error (a callable is called only then: the hot path formats nothing)."""

    def __init__(self, tp: TPGroup, what: str | Callable[[], str], start: Callable | None, finish=lambda: None, host_side=None):
        self._tp, self._what, self._finish, self._host_side = tp, what, finish, host_side
        try:
            self._work = start() if start is not None else None
        except (RuntimeError, dist.DistError) as e:
            raise _lost(tp, what() if callable(what) else what, e) from e

    def then(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Pending:
        """This collective, its result through `fn`."""
        finish = self._finish
        self._finish = lambda: fn(finish())
        return self

    def result(self) -> torch.Tensor:
        tp, work, what = self._tp, self._work, self._what
        if work is None:
            return self._finish()
        try:
            if tp.watcher is not None and (tp.backend == "gloo" if self._host_side is None else self._host_side):
                pause = 0.0002
                while not work.is_completed():
                    why = tp.watcher.stop_reason
                    if why:
                        raise PromptAbortedError(why)
                    if pause > 0.01 and tp.watcher.progress.waiting is None:  # waiting for a peer, not a copy
                        tp.watcher.progress.wait_begin(what() if callable(what) else what)
                    time.sleep(pause)
                    pause = min(pause * 2, 0.02)
            work.wait()  # raises if the collective failed
        except (RuntimeError, dist.DistError) as e:
            raise _lost(tp, what() if callable(what) else what, e) from e
        finally:
            if tp.watcher is not None:
                tp.watcher.progress.waiting = None
        return self._finish()


def start_reduce_scatter_rows(t: torch.Tensor, tp: TPGroup) -> Pending:
    """Sequence parallelism's reduce, started: sum `t` [S, ...] over ranks, this rank keeps S/tp_size rows. S must be a
    multiple of tp_size (callers pad). gloo has no reduce-scatter: there it is an all-reduce and a narrow, with the
    same sums."""
    what = f"reduce_scatter of {tuple(t.shape)} {t.dtype}"
    if tp.tp_size == 1:
        return Pending(tp, what, None, lambda: t)
    n = t.shape[0] // tp.tp_size
    if tp.backend == "nccl":
        out = torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device)
        return Pending(tp, what, lambda: dist.reduce_scatter_tensor(out, t.contiguous(), group=tp.group, async_op=True), lambda: out)
    return Pending(tp, what, lambda: dist.all_reduce(t, group=tp.group, async_op=True), lambda: t.narrow(0, tp.tp_rank * n, n).clone())


def start_all_gather_rows(t: torch.Tensor, tp: TPGroup) -> Pending:
    """Every rank's rows `t` [n, ...] stacked in rank order, [tp_size * n, ...], started."""
    what = f"all_gather of {tuple(t.shape)} {t.dtype}"
    if tp.tp_size == 1:
        return Pending(tp, what, None, lambda: t)
    out = torch.empty((t.shape[0] * tp.tp_size, *t.shape[1:]), dtype=t.dtype, device=t.device)
    if tp.backend == "nccl":
        return Pending(tp, what, lambda: dist.all_gather_into_tensor(out, t.contiguous(), group=tp.group, async_op=True), lambda: out)
    parts = list(out.chunk(tp.tp_size))
    return Pending(tp, what, lambda: dist.all_gather(parts, t.contiguous(), group=tp.group, async_op=True), lambda: out)


def start_all_to_all_rows(t: torch.Tensor, tp: TPGroup) -> Pending:
    """Row r of `t` [tp_size, L] to rank r, started: row r of the result is what rank r sent this rank."""
    out = torch.empty_like(t)
    return Pending(
        tp, f"all_to_all of {tuple(t.shape)} {t.dtype}", lambda: dist.all_to_all_single(out, t, group=tp.group, async_op=True), lambda: out
    )


def _cpu(op, tp: TPGroup, what: str, *args, **kwargs) -> None:
    Pending(tp, what, lambda: op(*args, group=tp.cpu_group, async_op=True, **kwargs), host_side=True).result()


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
    """Every rank's picklable object, in rank order: each rank's broadcast in turn (no padding to the longest)."""
    return [broadcast_object(obj if r == tp.tp_rank else None, tp, r) for r in range(tp.tp_size)]


def _map_tensors(obj, fn: Callable[[torch.Tensor], object]):
    """`obj` with every tensor inside its dicts, lists and tuples replaced by `fn(tensor)`, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def carries_tensors(value: object) -> bool:
    """Whether `value` is a tensor or a dict/list/tuple holding one at any depth (what broadcast_tree must carry)."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return any(carries_tensors(v) for v in value)
    return isinstance(value, torch.Tensor)


def broadcast_tree(obj: object, tp: TPGroup, src: int = 0) -> object:
    """Rank `src`'s nested dict/list/tuple of tensors and plain values on every rank: the structure, shapes and dtypes
    go over the CPU group, the tensors over the tensor group on `tp.device`. The other ranks pass None, or their own
    tree: see _receive_into."""
    if tp.tp_size == 1:
        return obj
    if tp.tp_rank == src:
        broadcast_object(_map_tensors(obj, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")), tp, src)
        tree = _map_tensors(obj, lambda t: t.to(tp.device).contiguous())
    else:
        tree = _receive_into(broadcast_object(None, tp, src), obj, tp.device)
    tensors: list[torch.Tensor] = []
    _map_tensors(tree, tensors.append)  # in the order both sides walk it
    what = f"broadcast of {len(tensors)} tensors"
    pending = [Pending(tp, what, lambda t=t: dist.broadcast(t, src=src, group=tp.group, async_op=True)) for t in tensors]
    for p in pending:
        p.result()
    return tree


def _receive_into(meta, own, device: torch.device):
    """Rank src's tree (its tensors on the meta device) with a tensor to receive each one into: this rank's own at the
    same place wherever rank src sends its own (same shape and dtype, contiguous on `device`), else a new one. So what
    rank src hands on by reference every rank hands on by reference, and an in-place change downstream (EasyCache adds
    to its model input in place, which ComfyUI's denoise then reads) lands alike on every rank."""
    if isinstance(meta, torch.Tensor):
        mine = isinstance(own, torch.Tensor) and (own.shape, own.dtype, own.device) == (meta.shape, meta.dtype, device)
        return own if mine and own.is_contiguous() else torch.empty(meta.shape, dtype=meta.dtype, device=device)
    if isinstance(meta, dict):
        return {k: _receive_into(v, own.get(k) if isinstance(own, dict) else None, device) for k, v in meta.items()}
    if isinstance(meta, (list, tuple)):
        same = isinstance(own, (list, tuple)) and len(own) == len(meta)
        return type(meta)(_receive_into(v, own[i] if same else None, device) for i, v in enumerate(meta))
    return meta
