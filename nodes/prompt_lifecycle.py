"""The prompt lifecycle on every rank (execution.PromptExecutor.execute_async): each prompt is a run every rank knows
by one id. Rank 0 dispatches each prompt to the followers as it starts (front door on); a rank whose prompt fails
tells every rank at once, with its reason (tp2/watch.py), and gives up its group.

Every rank clears its node cache before a prompt when any rank restarted since its last prompt (boot ids in the
store: a restarted rank has an empty cache) or reported a failed rendezvous or collective; anything else (e.g.
RAM-pressure eviction on one rank) is caught at the sampler rendezvous (a bounded wait, a clear error).

ComfyUI internals (execution.PromptExecutor, 0.33): for a prompt refused before it starts this writes `server.client_id`,
`status_messages` (through `add_message`), `success` and `history_result`, as execute_async does for a node's error;
`reset()` clears the node cache; `status_messages` is read after a run.
"""

from __future__ import annotations

import functools
import hashlib
import json
from types import SimpleNamespace

import comfy.model_management as mm
import execution

from ..tp2.handshake import prompt_details
from . import front_door
from .patches import PATCHES
from .state import STATE, Prompt, log

SEEN = SimpleNamespace(cache_epoch=0, boots={}, warnings={})  # at its last prompt: the cache epoch, each rank's boot id; nodes' warnings


def track_prompts() -> None:
    PATCHES.install(execution.PromptExecutor, "execute_async", _tracking_execute_async)


def _caches_may_differ() -> bool:
    """Whether, since this rank's last prompt, a rank restarted (a new boot id) or bumped the cache epoch."""
    epoch = STATE.session.cache_epoch() or 0  # None: the store is not reachable now
    changed, SEEN.cache_epoch = epoch > SEEN.cache_epoch, max(epoch, SEEN.cache_epoch)
    for r, boot in (STATE.session.boot_ids() or {}).items():
        changed |= SEEN.boots.get(r, boot) != boot  # a known id replaced; a first registration is no restart
        SEEN.boots[r] = boot
    return changed


async def _run_id(prompt, prompt_id, extra_data, execute_outputs) -> tuple[str, bool, str | None, dict]:
    """(run id, whether to clear the node cache, why the ranks are unavailable or None, boot ids known from rank 0)."""
    door = front_door.FRONT_DOOR
    if door is not None and STATE.env.tp_rank == 0:
        return (*await door.dispatch(prompt, prompt_id, extra_data, execute_outputs, _caches_may_differ()), {})
    order = door.orders.pop(prompt_id, None) if door is not None else None
    if order is None:  # every rank was given the prompt under one id
        return prompt_id, _caches_may_differ(), None, {}
    restarted = SEEN.boots.get(0, order["boot"]) != order["boot"]  # rank 0 restarted since this rank's last prompt: its cache is empty
    SEEN.boots[0] = order["boot"]
    return order["run"], order["reset"] or restarted, None, {0: order["boot"]}


def _tracking_execute_async(original):
    @functools.wraps(original)
    async def execute_async(self, prompt, prompt_id, extra_data={}, execute_outputs=[]):  # noqa: B006 - ComfyUI's signature
        session = STATE.session
        mm.interrupt_current_processing(False)  # as ComfyUI does as a prompt starts: an interrupt from now on is for this one
        # one order of output nodes on every rank (ComfyUI's comes from a set of strings, whose order differs between
        # processes), so the steps where the ranks meet (decodes, saved files) come in one order
        execute_outputs = sorted(execute_outputs, key=str)
        run, reset, refused, boots = await _run_id(prompt, prompt_id, extra_data, execute_outputs)
        if reset:
            log.info("%s a rank restarted, failed or freed memory since the last prompt: clearing this rank's node cache", STATE.tag)
            self.reset()
        fingerprint = hashlib.sha256(json.dumps(prompt, sort_keys=True, default=str).encode()).hexdigest()[:16]
        STATE.prompt = Prompt(prompt_id, run, fingerprint, prompt_details(prompt))
        session.watcher.begin(run, boots)
        try:
            if front_door.FRONT_DOOR is not None and STATE.env.tp_rank == 0 and mm.processing_interrupted():
                # interrupted while rank 0 handed it over (ComfyUI clears the flag as a prompt starts): it ends here,
                # and a follower that took it is told by the stop notice below
                _fail_before_start(self, prompt, prompt_id, extra_data, execute_outputs, None)
            elif refused:
                _fail_before_start(self, prompt, prompt_id, extra_data, execute_outputs, f"Tensor-parallel ranks unavailable: {refused}")
            else:
                await original(self, prompt, prompt_id, extra_data, execute_outputs)
        finally:
            _tell_warnings(self, prompt, prompt_id)
            failure = _failure(self)
            if failure is not None:
                if session.watcher.stop_reason is None:  # this rank stopped the run: every rank is told why
                    session.stop_run(f"rank {STATE.env.tp_rank} stopped the prompt: {failure}")
                else:
                    session.abandon_group()
                session.cache_epoch(bump=True)
            session.watcher.end()
            STATE.prompt = Prompt(fingerprint=STATE.prompt.fingerprint, model_calls=STATE.prompt.model_calls)

    return execute_async


def _tell_warnings(executor, prompt: dict, prompt_id: str) -> None:
    """The nodes' warnings (nodes/lora.py tell_node) where the user looks: in the prompt's history and to its client (the
    web UI toasts them, tp2-submit prints them). A node ComfyUI's cache served warns again, as its output still holds."""
    cached = {n for kind, d in executor.status_messages if kind == "execution_cached" for n in d.get("nodes", [])}
    for node_id, node in prompt.items():
        key = (node_id, json.dumps(node, sort_keys=True, default=str))
        if node_id in cached:
            STATE.prompt.warnings += SEEN.warnings.get(key, [])
        elif mine := [w for w in STATE.prompt.warnings if w["node_id"] == node_id]:
            SEEN.warnings[key] = mine
        else:
            SEEN.warnings.pop(key, None)
    if STATE.prompt.warnings:
        executor.add_message("tp2_warnings", {"prompt_id": prompt_id, "warnings": STATE.prompt.warnings}, broadcast=False)


def _failure(executor) -> str | None:
    """Why the prompt ComfyUI just ran failed on this rank (from its status messages), or None if it succeeded."""
    for kind, data in reversed(getattr(executor, "status_messages", [])):
        if kind == "execution_error":
            return f"{data.get('node_type')} failed: {data.get('exception_type')}: {' '.join(str(data.get('exception_message', '')).split())[:500]}"
        if kind == "execution_interrupted":
            return "interrupted"
    return None


def _fail_before_start(executor, prompt, prompt_id, extra_data, outputs, why: str | None) -> None:
    """Record the prompt as failed (`why`) or interrupted (None) without running a node, as ComfyUI records a node's."""
    log.warning("%s prompt %s not started: %s", STATE.tag, prompt_id, why or "interrupted while it was handed to the other ranks")
    executor.server.client_id = extra_data.get("client_id")
    executor.status_messages = []
    executor.add_message("execution_start", {"prompt_id": prompt_id}, broadcast=False)
    node_id = next(iter(outputs), None) or next(iter(prompt))
    where = {"prompt_id": prompt_id, "node_id": node_id, "node_type": prompt[node_id].get("class_type", "?"), "executed": []}
    if why is None:
        executor.add_message("execution_interrupted", where, broadcast=True)
    else:
        error = dict(where, exception_message=why, exception_type="TP2Error", traceback=[], current_inputs={}, current_outputs=[])
        executor.add_message("execution_error", error, broadcast=False)
    executor.success = False
    executor.history_result = {"outputs": {}, "meta": {}}
