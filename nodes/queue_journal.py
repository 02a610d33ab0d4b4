"""Rank 0's queue kept in the run directory, so a rank 0 that ends and is started again loses no prompt and no record.

Rank 0 under the launcher (TP2_SECRET_FILE names the run directory) writes its running and pending prompts and the
records of its last finished ones to RUN_DIR/rank0.queue.json (mode 0600) after every change of ComfyUI's PromptQueue,
a line per entry signed with the run's secret (tp2.signing). At start it restores the records, queues the pending
prompts again in their order, and records the prompt that was running as failed (it may be what ended the process).
A journal that is not what it writes (cut short, another shape, an entry that does not verify) never stops the pack:
the file is moved aside with a warning and every prompt id it names that is not queued again gets a failed record
saying why. API keys (ComfyUI's sensitive extra data) are never written. The launcher removes the journal at a fresh
start: `stop` ends the queue, as ComfyUI's own restart does.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time

from ..tp2.signing import signed, unsigned
from .patches import PATCHES
from .state import STATE, log

JOURNAL = "rank0.queue.json"
SIGNED_AS = "tp2/queue_journal"  # the store-key-like name each line's signature is made for
KEPT_RECORDS = 32  # finished prompts' history records kept across a restart
LOST = "rank 0's process ended while this prompt ran and the launcher started it again; queue the prompt again"
WATCHED = ("put", "get", "task_done", "wipe_queue", "delete_queue_item", "wipe_history", "delete_history_item")
_ID = re.compile(r'\[(?:"(?:running|pending)", *-?\d+|"history"), *"((?:[^"\\]|\\.)*)"')  # the prompt id of a line


def install_queue_journal(run_dir: str, secret: str) -> None:
    from server import PromptServer

    path = os.path.join(run_dir, JOURNAL)
    queue = PromptServer.instance.prompt_queue
    try:
        _restore(queue, PromptServer.instance, path, secret)
    except Exception as e:  # noqa: BLE001 - whatever the file holds, the pack loads
        _move_aside(path, [f"{type(e).__name__}: {e}"])
    for name in WATCHED:
        PATCHES.install(type(queue), name, functools.partial(_journaled, path, secret))
    _write(queue, path, secret)


def _journaled(path: str, secret: str, original):
    @functools.wraps(original)
    def method(queue, *args, **kwargs):
        out = original(queue, *args, **kwargs)
        if out is not None or original.__name__ != "get":  # a get that timed out changed nothing
            _write(queue, path, secret)
        return out

    return method


def _write(queue, path: str, secret: str) -> None:
    """The running and pending prompts (without index 5, their sensitive data) and the last records, a signed line each."""
    with queue.mutex:  # one order for every writer; re-entrant for wipe_queue inside delete_queue_item
        running, pending = queue.get_current_queue_volatile()
        rows = [["running", *i[:5]] for i in running] + [["pending", *i[:5]] for i in sorted(pending)]
        records = list(queue.history.items())[-KEPT_RECORDS:]
        rows += [["history", pid, {**h, "prompt": list(h["prompt"][:5])}] for pid, h in records if "prompt" in h]
        text = "".join(signed(secret, SIGNED_AS, json.dumps(r, default=str)) + "\n" for r in rows)
        try:
            fd = os.open(path + ".part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)
            with open(fd, "w") as f:
                f.write(text)
            os.replace(path + ".part", path)
        except OSError as e:
            log.warning("%s could not write the queue journal %s: %s", STATE.tag, path, e)


def _row(line: str, secret: str) -> tuple[list | None, str | None]:
    """(the entry of a journal line, None), or (None, why it is not one)."""
    try:
        row = json.loads(line.rpartition("|")[0])
    except ValueError:
        return None, "not a journal entry (cut short, or not written by the pack)"
    if unsigned(secret, SIGNED_AS, line) is None:
        return None, "its signature does not verify: rank 0 of this run did not write it"
    kinds = [type(v) for v in row] if isinstance(row, list) else []
    queued = kinds == [str, int, str, dict, dict, list] and row[0] in ("running", "pending")
    if not (queued or kinds == [str, str, dict] and row[0] == "history"):
        return None, "an entry of a shape the pack does not write"
    return row, None


def _restore(queue, server, path: str, secret: str) -> None:
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return
    problems, failed, again = [], {}, 0
    for n, line in enumerate(lines, 1):
        row, why = _row(line, secret)
        if row is None:
            problems.append(f"line {n}: {why}")
            if m := _ID.match(line):
                pid = json.loads(f'"{m[1]}"')
                failed[pid] = f"rank 0 restarted and could not read this prompt's entry in its queue journal ({why}): queue it again"
        elif row[0] == "history":
            queue.history[row[1]] = row[2]
        elif row[0] == "running":
            queue.history[row[2]] = _failed_record(row[1:], LOST)
        else:
            queue.put((server.number, *row[2:], {}))
            server.number, again = server.number + 1, again + 1
    for pid, why in failed.items():
        queue.history.setdefault(pid, _failed_record([-1, pid, {}, {}, []], why))
    if problems:
        _move_aside(path, problems)
    if again or failed:
        log.warning("%s rank 0 started again: %d prompt(s) of its queue put back, %d failed", STATE.tag, again, len(failed))


def _failed_record(item: list, why: str) -> dict:
    """A history record of prompt `item` (number, id, prompt, extra data, outputs) failed before it ran, as ComfyUI
    records a node's failure (what the panel, /history and tp2-submit read)."""
    now, pid = int(time.time() * 1000), item[1]
    error = {"prompt_id": pid, "node_id": None, "node_type": "queue journal", "executed": [], "exception_message": why,
             "exception_type": "TP2Error", "traceback": [], "current_inputs": {}, "current_outputs": [], "timestamp": now}  # fmt: skip
    messages = [["execution_start", {"prompt_id": pid, "timestamp": now}], ["execution_error", error]]
    return {"prompt": list(item), "outputs": {}, "status": {"status_str": "error", "completed": False, "messages": messages}, "meta": {}}


def _move_aside(path: str, problems: list[str]) -> None:
    aside = f"{path}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        os.replace(path, aside)
    except OSError as e:
        aside = f"nowhere ({e})"
    log.warning(
        "%s the queue journal %s is not what the pack writes (%s%s): moved to %s; prompts it names that were not queued again "
        "are recorded as failed", STATE.tag, path, "; ".join(problems[:3]), f"; {len(problems) - 3} more" if len(problems) > 3 else "", aside,
    )  # fmt: skip
