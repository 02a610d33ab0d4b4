"""A long-lived TP rank: agreement over a store that outlives process groups, and groups made by generation.

A peer restarts, a prompt reaches one rank only, one rank's node cache serves a sampler the other runs; a timed-out or
broken process group is unusable. So ranks agree over a TCPStore (hosted by rank 0, bounded polling, nothing left
half-done), and the tensor process group is (re)made, under a new generation, once every rank agreed. A stop (this
rank's, or a peer's that the watcher of tp2/watch.py sees) gives up the group; the next agreement makes a fresh one.

Under NCCL the pack aborts communicators itself (TORCH_NCCL_ASYNC_ERROR_HANDLING=0: PyTorch's watchdog must not end a
process because a peer failed; see `tp2.settings.set_for_libraries`). Imports torch only; never `comfy`.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .collectives import TPEnv, TPGroup, init_tp_group
from .errors import PeerLostError
from .handshake import PRIVATE
from .link import Link, measure_link, prediction
from .rendezvous import Rendezvous
from .settings import NCCL_ERROR_HANDLING, set_for_libraries, value, visible_gpus
from .signing import signed_counter
from .watch import Watcher


def is_loopback(addr: str) -> bool:
    try:
        return addr == "localhost" or ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


log = logging.getLogger(__name__)


class TPSession(Rendezvous):
    """This rank's membership in the TP world across prompts."""

    def __init__(self, env: TPEnv, device: torch.device | None = None, boot_id: str = "", secret: str | None = None,
                 peer_urls: list[str] | None = None):  # fmt: skip
        self.env = env
        self.tag = f"[tp2 r{env.tp_rank}/{env.tp_size}]"
        self.device = device
        self._store: dist.Store | None = None  # a follower's is dropped after a stop (rank 0 may have restarted behind it)
        self._listener: socket.socket | None = None  # rank 0: the store's socket, bound to MASTER_ADDR only
        self.group: TPGroup | None = None
        self.link: Link | None = None  # measured as each group forms (tp2/link.py)
        self.link_prediction = ""
        self.generation = 0
        self.healthy = False
        self._epoch_seen = 0  # the highest signed cache epoch this rank read or wrote
        self._retired: list[tuple[float, list]] = []  # (when, [groups]) given up, kept until their waits are over
        self.watcher = Watcher(env.tp_rank, env.tp_size, env.master_addr, env.master_port, boot_id, secret, peer_urls=peer_urls)
        self.watcher.on_stop = self._stopped_by_peer
        self.watcher.progress.stall_s, self.watcher.progress.between_s = value("TP2_STALL_S"), env.timeout_s

    def _connect(self, timeout_s: float) -> dist.Store:
        if self._store is not None:
            return self._store
        master = self.env.tp_rank == 0
        try:
            if master and self._listener is None:  # MASTER_ADDR only (TCPStore's own server listens on every interface)
                family = socket.AF_INET6 if ":" in self.env.master_addr else socket.AF_INET
                # with SO_REUSEADDR (create_server's default): a restarted rank 0 takes its port back at once
                self._listener = socket.create_server((self.env.master_addr, self.env.master_port), family=family, backlog=512)
            listen = {"master_listen_fd": self._listener.fileno()} if master else {}
            self._store = dist.TCPStore(self.env.master_addr, self.env.master_port, is_master=master, wait_for_workers=False,
                                        timeout=timedelta(seconds=timeout_s), **listen)  # fmt: skip
        except (RuntimeError, dist.DistError, OSError) as e:
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

    def stop_run(self, reason: str) -> None:
        """This rank stops the current run: tell every rank why (their watchers end their waits: gloo ones poll,
        NCCL ones abort the communicator), then give up this rank's group; the next agreement forms a new one."""
        self.watcher.publish_stop(reason)
        self.abandon_group()

    def abandon_group(self) -> None:
        """Leave the current process group now (after a stop); the next agreement forms a new generation."""
        self.healthy = False
        self.watcher.reconnect()
        if self.env.tp_rank != 0:
            self._store = None
        if self.group is not None and dist.is_initialized() and self.group.backend == "nccl":
            _abort_nccl()
        self._retire_group()

    def _retire_group(self) -> None:
        """Deregister the current group and keep it alive until its collectives can no longer be pending: a
        collective given up on may still wait in the group's threads (gloo has no abort), and destroying the group
        joins them, which at a random point (garbage collection, interpreter lock held) would freeze this process
        for up to TP2_TIMEOUT_S. Retired groups are released once that much time has passed."""
        now = time.monotonic()
        keep = [(t, pgs) for t, pgs in self._retired if now - t < self.env.timeout_s + 10]
        if self.group is not None:
            keep.append((now, [self.group.group, self.group.cpu_group]))
        self._retired = keep  # the expired ones are released here, their threads idle
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError, dist.DistError) as e:  # an aborted group may refuse a clean destroy
                log.warning("%s leaving the process group: %s", self.tag, e)
        self.group = None

    def _stopped_by_peer(self, reason: str) -> None:
        """The watcher's callback: a peer stopped the run, or went silent. Under NCCL the host does not wait on
        collectives (the GPU spins in them), so the communicator is aborted from here; under gloo the prompt worker
        polls and leaves by itself."""
        self.healthy = False
        group = self.group
        if group is not None and group.backend == "nccl":
            log.warning("%s aborting the NCCL communicator: %s", self.tag, reason)
            _abort_nccl()

    def agree(self, key: str, fields: dict[str, str], timeout_s: float, abort=None) -> TPGroup:
        """Rendezvous on `key`, then return a healthy process group every rank shares (made if needed)."""
        own = dict(fields, **{f"{PRIVATE}gen": str(self.generation), f"{PRIVATE}healthy": str(int(self.healthy))})
        everyone = self.rendezvous(key, own, timeout_s, abort)
        gens = [int(f[f"{PRIVATE}gen"]) for f in everyone]
        if self.group is None or len(set(gens)) > 1 or any(f[f"{PRIVATE}healthy"] != "1" for f in everyone):
            self._new_group(max(gens) + 1)
        return self.group

    def _new_group(self, generation: int) -> None:
        self._retire_group()
        self.healthy = False
        cuda = self.device is not None and self.device.type == "cuda"
        replaced = set_for_libraries(cuda=cuda, loopback=is_loopback(self.env.master_addr))
        if replaced:
            log.warning("%s %s=%s replaced by 0: the pack aborts NCCL itself, so no rank ends because a peer failed",
                        self.tag, NCCL_ERROR_HANDLING, replaced)  # fmt: skip
        store = dist.PrefixStore(f"tp2/pg/{generation}", self._connect(self.env.timeout_s))
        self.group = init_tp_group(self.env, self.device, store=store, watcher=self.watcher)
        self.link = measure_link(self.group, visible_gpus())
        self.link_prediction = prediction(self.link, self.env.tp_size, self.group.device.type)
        self.generation, self.healthy = generation, True
        log.info("%s process group generation %d formed; link: %s; %s", self.tag, generation, self.link.text(), self.link_prediction)
        if self.env.tp_rank == 0:  # earlier generations' keys (read only while a group forms) would stay in the store for good
            own = f"tp2/pg/{generation}/"
            try:
                self._store_op(5.0, lambda s: [s.delete_key(k) for k in s.list_keys() if k.startswith("tp2/pg/") and not k.startswith(own)])
            except (RuntimeError, dist.DistError, PeerLostError) as e:
                log.warning("%s could not delete earlier process groups' keys from the rank store: %s", self.tag, e)

    def register_boot(self, timeout_s: float) -> None:
        """Publish this process's boot id (a restarted rank has a new one, and an empty node cache)."""
        self._store_op(timeout_s, lambda s: s.set(f"tp2/boot/rank{self.env.tp_rank}", self.watcher.boot_id))

    def _now(self, fn):
        """`fn(store)` now, or None when the store is not reachable (told at once: rank 0 is gone) or does not answer."""
        return None if self.watcher.store_problem() is not None else self.watcher.store_call(fn)

    def boot_ids(self) -> dict[int, str] | None:
        """Each registered rank's current boot id; None when the store is unreachable."""
        keys = {r: f"tp2/boot/rank{r}" for r in range(self.env.tp_size)}
        return self._now(lambda s: {r: s.get(k).decode() for r, k in keys.items() if s.check([k])})

    def cache_epoch(self, bump: bool = False) -> int | None:
        """A counter every rank can raise when ranks may have run different nodes (a failed rendezvous or collective),
        signed like every store entry; None when the store is not reachable now. An epoch no rank signed is raised over."""
        read = self._now(lambda s: signed_counter(s, "tp2/cache_epoch", self.watcher.secret, bump, self._epoch_seen))
        epoch, forged = read or (None, False)
        if forged:  # read as a raise (every rank clears its node cache: safe), and written over, signed
            log.warning("%s the cache epoch in the rank store is not signed by a rank: raised over it", self.tag)
        self._epoch_seen = max(self._epoch_seen, epoch or 0)
        return epoch


def _abort_nccl() -> None:
    """Abort every NCCL communicator of this process (pending kernels exit; the group is unusable afterwards)."""
    try:
        dist.distributed_c10d._abort_process_group()
    except (RuntimeError, ValueError, AttributeError) as e:  # already destroyed, or no NCCL group
        log.debug("NCCL abort: %s", e)
