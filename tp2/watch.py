"""What every rank knows about the others between collectives: heartbeats, and why a run stopped. Imports torch only.

A rank that stops a run (a node's exception, out of memory, an interrupt, a failed load, a mismatch) publishes a stop notice
with its rank and reason under the run's id in the rank store. Every watcher thread reads the store every `POLL_S` and exposes
as `stop_reason` the first notice, or a peer whose heartbeat went quiet, that restarted, whose process ended (its HTTP
port refuses connections) or that is stuck in a lockstep step (tp2/progress.py); collectives and rendezvous poll it while
they wait, so a failure ends every wait within a poll.

    tp2/hb/rank{r}              "<boot id>:<count>:<step>#<marks>|<mac>", rewritten every POLL_S by rank r's watcher
    tp2/boot/rank{r}            rank r's boot id (rewritten too, so a restarted store learns it again)
    tp2/run/{run}/stop          the first stop notice of a run: JSON {rank, reason}
    tp2/run/{run}/state/rank{r} "started" or "done" (rank r finished the run, with or without an error)

A rank deletes its keys of a run once it has begun KEPT_RUNS runs after it. Every entry is signed (tp2/signing.py).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from .progress import WAITING, Progress
from .signing import signed, unsigned

log = logging.getLogger(__name__)

POLL_S = 0.5
HEARTBEAT_TIMEOUT_S = 15.0
PROBE_AFTER_S = 2.0  # a peer's heartbeat quiet this long: ask its HTTP port whether its process still exists
STORE_OP_TIMEOUT_S = 5.0
KEPT_RUNS = 2  # a rank keeps its store keys of its last runs: the current one, and the previous for a late peer


def describe_failure(rank: int, exc: BaseException, step: int | None = None, steps: int | None = None) -> str:
    """The one line every rank shows when rank `rank` stopped a run with `exc` (at sampling step `step` of `steps`)."""
    where = f" at step {step} of {steps}" if step is not None and steps else ""
    text = " ".join(str(exc).split())[:400] or type(exc).__name__
    if _is_out_of_memory(exc):
        return f"rank {rank} ran out of GPU memory{where} ({text}): use fewer frames, a lower resolution or more ranks"
    return f"rank {rank} failed{where}: {type(exc).__name__}: {text}"


def with_advice(exc: BaseException, advice: str | None) -> BaseException:
    """`exc` itself, or, for an out-of-memory error when there is advice (the capacity model's), the same error type
    with the advice leading its message: describe_failure cuts the text, so the advice comes first."""
    if advice is None or not _is_out_of_memory(exc):
        return exc
    try:
        return type(exc)(f"out of GPU memory; {advice}. {exc}")
    except Exception:  # noqa: BLE001 - an error type that takes no message keeps its own
        return exc


def _is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def oom_kills() -> int:
    """How many processes the kernel's out-of-memory killer has ended on this machine since boot (0 where not told)."""
    try:
        with open("/proc/vmstat") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), 0)
    except OSError:
        return 0


def _connect_error(host: str, port: int, timeout_s: float) -> OSError | None:
    """Why a TCP connection to `host`:`port` fails now (ConnectionRefusedError: nothing listens), else None."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        return e
    return None


class Watcher:
    """This rank's view of its peers; a daemon thread keeps it fresh. One run at a time (the prompt worker's)."""

    def __init__(self, rank: int, size: int, addr: str, port: int, boot_id: str, secret: str | None = None,
                 peer_urls: list[str] | None = None):  # fmt: skip
        self.rank, self.size, self.addr, self.port, self.boot_id = rank, size, addr, port, boot_id
        self.secret, self.heartbeat_timeout_s = secret, HEARTBEAT_TIMEOUT_S
        self.peer_urls = peer_urls or []  # every rank's HTTP address (TP2_RANK_URLS): a port that refuses = gone
        self.on_stop: Callable[[str], None] | None = None  # called once per run, from the watcher thread
        self._lock = threading.Lock()
        self.run: str | None = None  # the run being watched (rank 0 names it, unique per execution)
        self.stop_reason: str | None = None  # why the current run stops on this rank (a notice, a silent or restarted peer)
        self._beats = 0
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (last heartbeat value, when it last changed)
        self._boots: dict[int, str] = {}  # peer -> boot id when the run began
        self._ooms = oom_kills()  # the kernel's OOM kills when the run began: more since then name a peer's end
        self._store_failures = 0
        self._clients = threading.local()  # one store connection per thread (the watcher's, the prompt worker's)
        self._thread: threading.Thread | None = None
        self._runs: list[str] = []  # the runs whose keys this rank still keeps, oldest first
        self._forged: set[int] = set()  # ranks whose store heartbeat was found unsigned (logged once each)
        self.progress = Progress()  # this rank's place in the current lockstep step, told in its heartbeat
        self._moved: dict[int, tuple[str, float]] = {}  # peer -> (its progress token, when it last changed)
        self.waiting_text: str | None = None  # "waiting for rank 1 at ..." while a peer alive keeps this rank waiting
        self._said = 0.0  # when waiting_text was last logged

    # -- the run ---------------------------------------------------------------------------------------
    def heartbeat_ages(self) -> dict[int, float]:
        """Seconds since each peer's heartbeat last changed, as this watcher saw it (empty before the first poll)."""
        now = time.monotonic()
        return {r: now - when for r, (_, when) in sorted(dict(self._seen).items())}

    def begin(self, run: str, boots: dict[int, str] | None = None) -> None:
        """Start watching run `run`; `boots` are peers' boot ids known to be part of it (rank 0's, from its order).
        Other peers' are taken from their first heartbeat read during the run: a change after that is a restart."""
        with self._lock:
            self.run, self.stop_reason = run, None
            self._boots, self._ooms = dict(boots or {}), oom_kills()
        self.progress.end()
        self.store_call(lambda s: s.set(f"tp2/run/{run}/state/rank{self.rank}", "started"), "rank store unreachable")
        self._runs.append(run)
        if len(self._runs) > KEPT_RUNS:
            old = self._runs.pop(0)
            self.store_call(lambda s: [s.delete_key(k) for k in (f"tp2/run/{old}/state/rank{self.rank}", f"tp2/run/{old}/stop")])

    def end(self) -> None:
        with self._lock:
            run, self.run = self.run, None
        self.progress.end()
        if run is not None and self.store_problem() is None:
            self.store_call(lambda s: s.set(f"tp2/run/{run}/state/rank{self.rank}", "done"), "rank store unreachable")

    def publish_stop(self, reason: str) -> None:
        """Tell every rank that this rank stopped the current run, and why (the first notice of a run wins)."""
        run = self.run
        if run is None:
            return
        with self._lock:
            self.stop_reason = self.stop_reason or reason  # this rank waits for nothing more in this run either
        if self.store_problem() is not None:  # no store, no peer to tell (rank 0 is gone)
            return
        key = f"tp2/run/{run}/stop"
        notice = signed(self.secret, key, json.dumps({"rank": self.rank, "reason": reason}))
        self.store_call(lambda s: s.compare_set(key, "", notice), f"could not publish why the run stopped ({reason})")  # if none yet

    def read_stop(self, run: str) -> str | None:
        """The run's stop notice, read now (not at the next poll): why a peer that finished the run stopped it."""
        notice = self._notice(run, self._get(f"tp2/run/{run}/stop"))
        return notice[1] if notice is not None and notice[0] != self.rank else None

    def _notice(self, run: str, raw: str | None) -> tuple[int, str] | None:
        """(rank, reason) of run `run`'s stop notice `raw`, or None when there is none, it is malformed or no rank signed it."""
        try:
            notice = json.loads(unsigned(self.secret, f"tp2/run/{run}/stop", raw or ""))
            return int(notice["rank"]), str(notice["reason"])
        except (ValueError, KeyError, TypeError):
            return None

    def store_problem(self) -> str | None:
        """Why the rank store cannot be reached right now, told at once (rank 0 hosts it, so a rank 0 that died leaves a
        closed port): also, after a collective broke without a stop notice, who is gone. None while it answers."""
        refused = None if self.rank == 0 else _connect_error(self.addr, self.port, 1.0)
        if refused is None:
            return None
        return f"rank 0 died (its rank store at {self.addr}:{self.port} is gone: {refused}); scripts/start-tp2.sh restarts it, then queue the prompt again"

    def peer_state(self, run: str, rank: int) -> str | None:
        return self._get(f"tp2/run/{run}/state/rank{rank}")

    # -- the thread ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"tp2-watch-r{self.rank}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - the watcher must outlive any one bad poll
                log.warning("[tp2 r%d/%d] watcher: %s", self.rank, self.size, e)
            time.sleep(POLL_S)

    def poll(self) -> None:
        """One round: beat, read the peers and the current run's stop notice; decide whether the run must stop."""
        now = time.monotonic()
        try:
            store = self._client()
            self._beats += 1
            beat = f"{self.boot_id}:{self._beats}:{self.progress.token()}"
            store.set(f"tp2/hb/rank{self.rank}", signed(self.secret, f"tp2/hb/rank{self.rank}", beat))
            store.set(f"tp2/boot/rank{self.rank}", self.boot_id)
            hb = [f"tp2/hb/rank{r}" for r in range(self.size)]
            beats = store.multi_get(hb) if store.check(hb) else None
            run = self.run
            raw = store.get(f"tp2/run/{run}/stop") if run is not None and store.check([f"tp2/run/{run}/stop"]) else None
            self._store_failures = 0
        except (RuntimeError, dist.DistError) as e:
            self._clients.store = None
            self._store_failures += 1
            if self._store_failures >= 3 and self.rank != 0:
                self._decide(f"rank 0 is not answering (its rank store at {self.addr}:{self.port}: {str(e).splitlines()[0][:200]}): "
                             "it died, froze or is restarting; scripts/start-tp2.sh restarts ranks that die")  # fmt: skip
            return
        if raw:
            notice = self._notice(run, raw.decode(errors="replace"))
            if notice is None:
                log.warning("[tp2 r%d/%d] ignored a stop notice for run %s that no rank signed", self.rank, self.size, run)
            elif notice[0] != self.rank:
                if notice[1].startswith(f"rank {self.rank} is stuck") and self.stop_reason is None:  # where: for its log
                    log.error("[tp2 r%d/%d] %s; this rank's Python stacks follow", self.rank, self.size, notice[1])
                    faulthandler.dump_traceback(all_threads=True)
                self._decide(notice[1])
        if self.progress.waiting is None:
            self.waiting_text = None
        for r, value in enumerate(beats or []):
            if r != self.rank:
                self._judge_peer(r, value.decode(), run, now)

    def _judge_peer(self, r: int, raw: str, run: str | None, now: float) -> None:
        """Peer r's heartbeat as read now: a restart, an ended process, a silence or no progress stops the current run."""
        value = unsigned(self.secret, f"tp2/hb/rank{r}", raw)
        if value is None:  # written by something that is not a rank of this run: not a heartbeat
            if r not in self._forged:
                self._forged.add(r)
                log.warning("[tp2 r%d/%d] ignored a heartbeat for rank %d that no rank signed", self.rank, self.size, r)
            return
        if self._seen.get(r, (None,))[0] != value:
            self._seen[r] = (value, now)
        boot = value.split(":")[0]
        if run is None:
            return
        if self._boots.setdefault(r, boot) != boot:
            self._decide(f"rank {r} restarted during the prompt (it died and came back): queue the prompt again", publish=True)
        quiet = now - self._seen[r][1]
        if quiet > PROBE_AFTER_S and self._process_gone(r):
            self._decide(f"rank {r} ended: its heartbeat stopped {quiet:.0f} s ago and its HTTP port refuses connections "
                         f"({self.why_ended()}); scripts/start-tp2.sh starts it again", publish=True)  # fmt: skip
        if quiet > self.heartbeat_timeout_s:
            self._decide(f"rank {r} is not responding (no heartbeat for {quiet:.0f} s): it is frozen, stopped or overloaded; "
                         "check its log, or restart it with scripts/start-tp2.sh restart --rank " + str(r), publish=True)  # fmt: skip
        token = value.split(":", 2)[-1]
        stuck = quiet <= PROBE_AFTER_S and self.progress.stuck(r, token, now)
        if stuck:  # only while its heartbeat goes on: a silent peer is frozen or gone, named above
            self._decide(stuck, publish=True)
        if self._moved.get(r, ("",))[0] != token.removesuffix(WAITING):
            self._moved[r] = (token.removesuffix(WAITING), now)
        stalled = quiet <= PROBE_AFTER_S and self.progress.stalled(r, token, now - self._moved[r][1], now)
        if stalled and stalled[1]:
            self._decide(stalled[0], publish=True)
        elif stalled:
            self.waiting_text = stalled[0]
            if now - self._said >= self.progress.report_s():
                self._said = now
                log.warning("[tp2 r%d/%d] %s", self.rank, self.size, stalled[0])

    def why_ended(self) -> str:
        """Why a peer's process ended, as far as this machine tells: the OOM killer acted during the run, or unknown."""
        if oom_kills() > self._ooms:
            return ("the kernel's out-of-memory killer ended a process on this machine during this prompt: the host ran out "
                    "of RAM; scripts/start-tp2.sh check shows the host memory the ranks need")  # fmt: skip
        return "killed, crashed or out of host memory; its log says which"

    def _process_gone(self, rank: int) -> bool:
        """Whether rank `rank`'s HTTP port refuses connections: its process ended. A frozen or busy process's port
        still accepts (the kernel does) and an unreachable one proves nothing, so a slow rank is never taken for dead."""
        if rank >= len(self.peer_urls):
            return False
        where = urlsplit(self.peer_urls[rank])
        return isinstance(_connect_error(where.hostname, where.port or 80, 0.5), ConnectionRefusedError)

    def _decide(self, reason: str, publish: bool = False) -> None:
        """The current run stops on this rank for `reason` (once per run); `publish`: tell the other ranks too (a
        silent or restarted peer did not, and finds out when it comes back)."""
        with self._lock:
            if self.run is None or self.stop_reason is not None:
                return
            self.stop_reason = reason
        log.warning("[tp2 r%d/%d] stopping run %s: %s", self.rank, self.size, self.run, reason)
        if publish:
            self.publish_stop(reason)
        if self.on_stop is not None:
            self.on_stop(reason)

    # -- the store -------------------------------------------------------------------------------------
    def reconnect(self) -> None:
        """Drop this thread's store connection (after a failure: rank 0 may have restarted behind it)."""
        self._clients.store = None

    def _client(self) -> dist.Store:
        if getattr(self._clients, "store", None) is None:
            self._clients.store = dist.TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False,
                                                timeout=timedelta(seconds=STORE_OP_TIMEOUT_S))  # fmt: skip
        return self._clients.store

    def store_call(self, fn: Callable[[dist.Store], object], warn: str | None = None):
        """`fn(store)` over this thread's connection; None, `warn` logged, when the store does not answer (then it is dropped)."""
        try:
            return fn(self._client())
        except (RuntimeError, dist.DistError) as e:
            self._clients.store = None
            if warn:
                log.warning("[tp2 r%d/%d] %s: %s", self.rank, self.size, warn, e)
            return None

    def _get(self, key: str) -> str | None:
        return self.store_call(lambda s: s.get(key).decode() if s.check([key]) else None)
