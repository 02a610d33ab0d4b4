"""Rank 0's queue kept in the run directory, so a rank 0 that ends and is started again loses no prompt.

Rank 0 under the launcher (TP2_SECRET_FILE names the run directory) writes its running and pending prompts to
RUN_DIR/rank0.queue.json after every change of ComfyUI's PromptQueue, and at start queues a journal left there
again, in its order. The prompt that was running is failed at start (extra_data[LOST] says why), not run again: it
may be what ended the process. API keys (ComfyUI's sensitive extra data) are never written. The launcher removes
the journal at a fresh start: `stop` ends the queue, as ComfyUI's own restart does.
"""

from __future__ import annotations

import functools
import json
import os

from ..tp2 import settings
from .patches import PATCHES
from .state import STATE, log

JOURNAL = "rank0.queue.json"
LOST = "tp2_lost_in_restart"  # extra_data key of a prompt that was running when rank 0 ended
WATCHED = ("put", "get", "task_done", "wipe_queue", "delete_queue_item")


def install_queue_journal() -> None:
    secret_file = settings.value("TP2_SECRET_FILE")
    if STATE.env.tp_rank != 0 or not secret_file:
        return
    from server import PromptServer

    path = os.path.join(os.path.dirname(secret_file), JOURNAL)
    queue = PromptServer.instance.prompt_queue
    _queue_again(queue, PromptServer.instance, path)
    for name in WATCHED:
        PATCHES.install(type(queue), name, functools.partial(_journaled, path))
    _write(queue, path)


def _journaled(path: str, original):
    @functools.wraps(original)
    def method(queue, *args, **kwargs):
        out = original(queue, *args, **kwargs)
        if out is not None or original.__name__ != "get":  # a get that timed out changed nothing
            _write(queue, path)
        return out

    return method


def _write(queue, path: str) -> None:
    """The running and pending prompts, without their sensitive data (index 5), written whole or not at all."""
    with queue.mutex:  # one order for every writer; re-entrant for wipe_queue inside delete_queue_item
        running, pending = queue.get_current_queue_volatile()
        items = {"running": [list(i[:5]) for i in running], "pending": [list(i[:5]) for i in sorted(pending)]}
        try:
            with open(path + ".part", "w") as f:
                json.dump(items, f, default=str)
            os.replace(path + ".part", path)
        except OSError as e:
            log.warning("%s could not write the queue journal %s: %s", STATE.tag, path, e)


def _queue_again(queue, server, path: str) -> None:
    try:
        with open(path) as f:
            items = json.load(f)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        log.warning("%s the queue journal %s cannot be read (%s): its prompts are not queued again", STATE.tag, path, e)
        return
    why = "rank 0's process ended while this prompt ran and the launcher started it again; queue the prompt again"
    again = [(i, {**i[3], LOST: why}) for i in items.get("running", [])] + [(i, i[3]) for i in items.get("pending", [])]
    for (_, prompt_id, prompt, _, outputs), extra in again:
        queue.put((server.number, prompt_id, prompt, extra, outputs, {}))
        server.number += 1
    if again:
        log.warning(
            "%s rank 0 started again: %d prompt(s) of its queue put back (%d to fail: it was running when rank 0 ended)",
            STATE.tag, len(again), len(items.get("running", [])),
        )  # fmt: skip
