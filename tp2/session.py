"""A long-lived TP rank: agreement over a store that outlives process groups, and groups made by generation.

ComfyUI servers run for days: a peer restarts, a prompt reaches one rank only, one rank's node cache serves a
sampler the other runs. A collective cannot say "wait at most T for a peer that may never come, then carry on
healthy": a timed-out or broken process group is unusable. So ranks agree over a TCPStore (hosted by rank 0,
bounded polling, nothing left half-done), and the tensor process group is created, or re-created under a new
generation, only once every rank has said it is about to run the same thing.

    session.agree(key, fields)  -> TPGroup ready for collectives, or PeerLostError / RankMismatchError
    session.mark_broken()        after a failed collective: the next agreement makes a fresh group

Imports torch only; never `comfy`.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .collectives import TPEnv, TPGroup, init_tp_group
from .errors import PeerLostError, PromptAbortedError
from .handshake import compare_fields

log = logging.getLogger(__name__)

POLL_S = 0.05
_PRIVATE = "_tp2_"  # field-name prefix for the session's own bookkeeping (not compared)


class TPSession:
    """This rank's membership in the TP world across prompts."""

    def __init__(self, env: TPEnv, device: torch.device | None = None):
        self.env = env
        self.device = device
        self._store: dist.Store | None = None
        self.group: TPGroup | None = None
        self.generation = 0
        self.healthy = False

    @property
    def tag(self) -> str:
        return f"[tp2 r{self.env.tp_rank}/{self.env.tp_size}]"

    # -- the store -------------------------------------------------------------------------------------
    def _connect(self, timeout_s: float) -> dist.Store:
        if self._store is None:
            master = self.env.tp_rank == 0
            try:
                self._store = dist.TCPStore(
                    self.env.master_addr,
                    self.env.master_port,
                    is_master=master,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s),
                )
            except (RuntimeError, dist.DistError) as e:
                who = "open" if master else "reach rank 0's"
                raise PeerLostError(
                    f"{self.tag} cannot {who} TP store at {self.env.master_addr}:{self.env.master_port} within "
                    f"{timeout_s:.0f} s ({e}). Start rank 0 (or free that port) and check MASTER_ADDR/MASTER_PORT."
                ) from e
        return self._store

    def _store_op(self, timeout_s: float, fn):
        """Run `fn(store)`; on a broken connection (rank 0 restarted) reconnect once and retry."""
        try:
            return fn(self._connect(timeout_s))
        except (RuntimeError, dist.DistError):
            if self.env.tp_rank == 0:
                raise
            self._store = None
            return fn(self._connect(timeout_s))

    # -- agreement -------------------------------------------------------------------------------------
    def rendezvous(self, key: str, fields: dict[str, str], timeout_s: float, abort=None) -> list[dict[str, str]]:
        """Publish `fields` under `key` and wait (at most `timeout_s`) for every rank's; compare them.

        Raises PeerLostError naming the ranks that did not arrive, RankMismatchError naming the fields that
        differ (every rank sees every rank's fields, so every rank raises the same), or PromptAbortedError when
        any rank called `abort_rendezvous(key, why)` or this rank's `abort()` returns a reason while waiting.
        """
        keys = [f"tp2/rv/{key}/rank{r}" for r in range(self.env.tp_size)]
        abort_key = f"tp2/rv/{key}/abort"
        mine = json.dumps(fields, sort_keys=True)
        self._store_op(timeout_s, lambda s: s.set(keys[self.env.tp_rank], mine))
        deadline = time.monotonic() + timeout_s
        while True:
            present = self._store_op(timeout_s, lambda s: [s.check([k]) for k in keys])
            if all(present):
                break
            why = abort() if abort is not None else None
            if why:
                self.abort_rendezvous(key, why)
            if self._store_op(timeout_s, lambda s: s.check([abort_key])):
                reason = self._store_op(timeout_s, lambda s: s.get(abort_key)).decode()
                raise PromptAbortedError(f"{self.tag} '{key}' was cancelled: {reason}")
            if time.monotonic() > deadline:
                self._store_op(timeout_s, lambda s: s.delete_key(keys[self.env.tp_rank]))
                missing = [r for r, ok in enumerate(present) if not ok]
                raise PeerLostError(
                    f"{self.tag} rank(s) {', '.join(map(str, missing))} did not reach '{key}' within {timeout_s:.0f} s: "
                    "they were not given the same prompt (same prompt id, e.g. through scripts/tp2-submit), served it "
                    "from their node cache, or are not running. Check their logs and queue the prompt on every rank."
                )
            time.sleep(POLL_S)
        everyone = [json.loads(v) for v in self._store_op(timeout_s, lambda s: [s.get(k) for k in keys])]
        compare_fields(everyone, self.tag, f"prompt '{key}'", skip_prefix=_PRIVATE)
        return everyone

    def abort_rendezvous(self, key: str, why: str) -> None:
        """Make every rank waiting at (or later reaching) `key` give up with `why`."""
        self._store_op(self.env.timeout_s, lambda s: s.set(f"tp2/rv/{key}/abort", why))

    def agree(self, key: str, fields: dict[str, str], timeout_s: float, abort=None) -> TPGroup:
        """Rendezvous on `key`, then return a healthy process group every rank shares (made if needed)."""
        own = dict(fields, **{f"{_PRIVATE}gen": str(self.generation), f"{_PRIVATE}healthy": str(int(self.healthy))})
        everyone = self.rendezvous(key, own, timeout_s, abort)
        gens = [int(f[f"{_PRIVATE}gen"]) for f in everyone]
        if self.group is not None and len(set(gens)) == 1 and all(f[f"{_PRIVATE}healthy"] == "1" for f in everyone):
            return self.group
        self._new_group(max(gens) + 1)
        return self.group

    def _new_group(self, generation: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.group, self.healthy = None, False
        store = dist.PrefixStore(f"tp2/pg/{generation}", self._connect(self.env.timeout_s))
        self.group = init_tp_group(self.env, self.device, store=store)
        self.generation, self.healthy = generation, True
        log.info("%s process group generation %d formed", self.tag, generation)

    def register_boot(self, boot_id: str, timeout_s: float) -> None:
        """Publish this process's boot id (a restarted rank has a new one, and an empty node cache)."""
        self._store_op(timeout_s, lambda s: s.set(f"tp2/boot/rank{self.env.tp_rank}", boot_id))

    def boot_ids(self) -> list[str | None] | None:
        """Every rank's current boot id (None for a rank not registered yet); None when the store is unreachable."""
        if self._store is None:
            return None
        keys = [f"tp2/boot/rank{r}" for r in range(self.env.tp_size)]
        try:
            return self._store_op(5.0, lambda s: [s.get(k).decode() if s.check([k]) else None for k in keys])
        except (RuntimeError, dist.DistError, PeerLostError):
            return None

    def cache_epoch(self, bump: bool = False) -> int | None:
        """A counter every rank can raise when ranks may have run different nodes (a failed rendezvous or
        collective); None when the store is not reachable now."""
        if self._store is None:
            return None
        try:
            return int(self._store_op(5.0, lambda s: s.add("tp2/cache_epoch", 1 if bump else 0)))
        except (RuntimeError, dist.DistError, PeerLostError):
            return None

    def mark_broken(self) -> None:
        """A collective failed (peer died or timed out): the next `agree` builds a new group."""
        self.healthy = False

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.group, self.healthy, self._store = None, False, None
