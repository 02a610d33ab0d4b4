"""The rendezvous every TP step starts with: each rank publishes its fields under a key in the rank store, waits for every
rank's, and all compare them; then one verdict, written by the first rank to decide and obeyed by every rank, says whether
they go on or why the run stops, so a stop near the arrival never stops one rank and lets another go on.

    tp2/rv/{key}/rank{r}   rank r's fields (signed, tp2/signing.py)
    tp2/rv/{key}/verdict   "go" or why the run stops (signed)
    tp2/rv/{key}/read      how many ranks have read; the last deletes the step's keys

`Rendezvous` is a part of tp2.session.TPSession (its store, watcher, tag and stop_run). Imports torch only; never `comfy`.
"""

from __future__ import annotations

import json
import logging
import time

import torch.distributed as dist

from .errors import PeerLostError, PromptAbortedError, RankMismatchError
from .handshake import compare_fields
from .signing import signed, unsigned

log = logging.getLogger("tp2.session")

POLL_S = 0.05


class Rendezvous:
    def rendezvous(self, key: str, fields: dict[str, str], timeout_s: float, abort=None) -> list[dict[str, str]]:
        """Publish `fields` under `key`, wait for every rank's and compare them (RankMismatchError on every rank);
        every rank's fields, in rank order. A peer executing this run is waited for while it lives; one that has not
        started the run within `timeout_s`, or finished it without reaching `key` (its node cache served the step),
        is a PeerLostError naming it. A stop of the run by any rank (or `abort()` here) is a PromptAbortedError with its reason."""
        base = f"tp2/rv/{key}"
        keys = [f"{base}/rank{r}" for r in range(self.env.tp_size)]
        mine = signed(self.watcher.secret, keys[self.env.tp_rank], json.dumps(fields, sort_keys=True))
        everyone = self._records(key, keys, timeout_s, abort, mine)
        own = abort() if abort is not None else None
        verdict = self._verdict(base, own or self.watcher.stop_reason or "go", timeout_s)
        if self._store_op(timeout_s, lambda s: s.add(f"{base}/read", 1)) == self.env.tp_size:
            self._store_op(timeout_s, lambda s: [s.delete_key(k) for k in (*keys, f"{base}/read", f"{base}/verdict")])
        compare_fields(everyone, self.tag, f"prompt '{key}'")  # the same verdict on every rank
        if verdict != "go":
            if verdict == own:
                self.stop_run(own)
            raise PromptAbortedError(f"{self.tag} '{key}' was cancelled: {verdict}")
        return everyone

    def _records(self, key: str, keys: list[str], timeout_s: float, abort, mine: str) -> list[dict[str, str]]:
        """Every rank's record (_wait_for_all), once each carries a valid signature: a record no rank signed is
        ignored (logged, never shown) and its rank writes its own again; one still there after `timeout_s` refuses the run."""
        run, deadline, base = self.watcher.run, time.monotonic() + timeout_s, f"tp2/rv/{key}"
        while True:
            self._wait_for_all(key, keys, timeout_s, abort, mine)
            try:
                raws = self._store_op(timeout_s, lambda s: [s.get(k) for k in keys])
            except (RuntimeError, dist.DistError):  # a peer took its key back between our check and our read: it saw a stop
                why = self._verdict(base, None, timeout_s) or self.watcher.stop_reason or (self.watcher.read_stop(run) if run else None)
                if why:
                    raise PromptAbortedError(f"{self.tag} '{key}' was cancelled: {why}") from None
                raise
            texts = [unsigned(self.watcher.secret, k, raw.decode()) for k, raw in zip(keys, raws)]
            if None not in texts:
                return [json.loads(text) for text in texts]
            forged = [k for k, text in zip(keys, texts) if text is None]
            log.warning("%s rendezvous records no rank signed, ignored: %s", self.tag, ", ".join(forged))
            if time.monotonic() > deadline:
                raise RankMismatchError(
                    f"{self.tag} the record at '{forged[0]}' in the rank store was not written by a rank of this set (no valid "
                    "signature), and its rank did not write it again: something else writes to the store. Restart the ranks "
                    "with scripts/start-tp2.sh."
                )
            time.sleep(POLL_S)

    def _wait_for_all(self, key: str, keys: list[str], timeout_s: float, abort, mine: str) -> None:
        """Until every rank's record is in the store, or raise: a stop (the verdict, unless some rank already took
        "go"), a peer that finished the run without this step, or one that never started it. This rank's own record
        (`mine`) is written at the first poll, and again when it is gone (a restarted rank 0's new store) or replaced."""
        deadline, polls, me, run, base = time.monotonic() + timeout_s, 0, keys[self.env.tp_rank], self.watcher.run, f"tp2/rv/{key}"
        self.watcher.progress.wait_begin(f"the rendezvous '{key.rsplit('/', 1)[-1]}'")  # told in the heartbeat
        try:
            while True:
                present = self._store_op(timeout_s, lambda s: [s.check([k]) for k in keys])
                if not present[self.env.tp_rank] or self._store_op(timeout_s, lambda s: s.get(me).decode()) != mine:
                    self._store_op(timeout_s, lambda s: s.set(me, mine))
                    present[self.env.tp_rank] = True
                own = abort() if abort is not None else None
                stop = own or self.watcher.stop_reason
                if stop and self._verdict(base, stop, timeout_s) != "go":
                    if own:
                        self.stop_run(own)
                    self._store_op(timeout_s, lambda s: s.delete_key(keys[self.env.tp_rank]))
                    raise PromptAbortedError(f"{self.tag} '{key}' was cancelled: {stop}")
                if all(present) or stop:  # stop: a rank that saw every record took "go" first; go on with it
                    return
                missing = [r for r, ok in enumerate(present) if not ok]
                polls += 1
                past = time.monotonic() > deadline
                # where the missing peers are in this run (read every 5th poll, and each poll once the deadline passed)
                states = {r: self.watcher.peer_state(run, r) for r in missing} if run is not None and (past or polls % 5 == 0) else {}
                finished = [r for r, st in states.items() if st == "done"]
                if finished or (past and (run is None or any(st is None for st in states.values()))):
                    self._store_op(timeout_s, lambda s: s.delete_key(keys[self.env.tp_rank]))
                    self._give_up(key, run, finished, missing, timeout_s)
                time.sleep(POLL_S)
        finally:
            self.watcher.progress.waiting = None

    def _verdict(self, base: str, proposal: str | None, timeout_s: float) -> str | None:
        """The rendezvous' one verdict, "go" or why the run stops: `proposal` if this rank decides first, else the one
        taken (`proposal` None: only read it; None if there is none). A verdict no rank signed stops the run."""
        where = f"{base}/verdict"
        if proposal is None:
            raw = self._store_op(timeout_s, lambda s: s.get(where) if s.check([where]) else b"").decode()
            if not raw:
                return None
        else:
            raw = self._store_op(timeout_s, lambda s: s.compare_set(where, "", signed(self.watcher.secret, where, proposal))).decode()
        verdict = unsigned(self.watcher.secret, where, raw)
        if verdict is None:
            log.warning("%s the rendezvous verdict at %s is not signed by a rank: the run stops", self.tag, where)
            return "the rank store holds a rendezvous verdict no rank of this set wrote; restart the ranks with scripts/start-tp2.sh"
        return verdict

    def _give_up(self, key: str, run: str | None, finished: list[int], missing: list[int], timeout_s: float) -> None:
        """Raise why the rendezvous at `key` ends without the `missing` peers (`finished`: those done with the run)."""
        why = self.watcher.read_stop(run) if run is not None else None
        if why:  # the peer finished the run because it stopped it: its reason, not a guess
            raise PromptAbortedError(f"{self.tag} '{key}' was cancelled: {why}")
        who = ", ".join(map(str, finished or missing))
        if finished:
            raise PeerLostError(
                f"{self.tag} rank(s) {who} finished the prompt without reaching '{key}': their node cache served "
                "this step. Every rank clears its node cache before the next prompt; queue it again."
            )
        raise PeerLostError(
            f"{self.tag} rank(s) {who} did not reach '{key}' within {timeout_s:.0f} s: they were not given the "
            "same prompt (queue prompts on rank 0, or submit the same prompt id to every rank), or are not running. "
            "Check their logs (scripts/start-tp2.sh status)."
        )
