"""The rank handshake: before the first tensor collective, ranks prove they agree on what they will run.

Each rank sends a flat dict of fingerprint fields over the CPU group; if any field differs, every rank raises
`RankMismatchError` naming the field and each rank's value. The same call compares per-prompt fingerprints.
Imports torch only (via `collectives`); never `comfy`.
"""

from __future__ import annotations

import hashlib
import json
import logging

from . import __version__
from .collectives import TPGroup, all_gather_object
from .errors import RankMismatchError

log = logging.getLogger(__name__)


def model_fingerprint(plan_fingerprint: str, checkpoint_fingerprint: str, tp_size: int) -> dict[str, str]:
    """The fields ranks must share before they load and run a model."""
    return {
        "pack_version": __version__,
        "plan": plan_fingerprint,
        "checkpoint": checkpoint_fingerprint,
        "tp_size": str(tp_size),
    }


DETAIL = "detail:"  # a field `<skip_prefix>detail:<key>` holds JSON {label: short value} explaining field <key>


def compare_fields(everyone: list[dict[str, str]], tag: str, what: str, skip_prefix: str = "\0") -> None:
    """Raise RankMismatchError naming every field whose value differs between ranks (ranks in list order).

    A differing field that comes with details (`<skip_prefix>detail:<field>`, e.g. the prompt's nodes and inputs)
    is explained by the labels whose values differ: "node 5 (KSampler) input 'seed' (rank 0: 1, rank 1: 2)"."""
    diffs = []
    for key in sorted({k for f in everyone for k in f if not k.startswith(skip_prefix)}):
        values = [f.get(key, "<missing>") for f in everyone]
        if len(set(values)) > 1:
            diffs.append(f"'{key}' (" + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)) + ")")
            diffs.extend(_explain([f.get(f"{skip_prefix}{DETAIL}{key}") for f in everyone]))
    if diffs:
        raise RankMismatchError(
            f"{tag} ranks disagree on the {what}: {'; '.join(diffs)}. Every rank must run the same pack version, "
            "checkpoint, tp_size and workflow (graph, seeds, models, LoRAs): give all ranks the same files and prompt."
        )


def _explain(details: list[str | None], most: int = 6) -> list[str]:
    """The labels whose values differ between ranks' details (at most `most`, then how many more)."""
    if any(d is None for d in details):
        return []
    maps = [json.loads(d) for d in details]
    labels = sorted({k for m in maps for k in m})
    out = []
    for label in labels:
        values = [m.get(label, "<missing>") for m in maps]
        if len(set(values)) > 1:
            out.append(f"{label} (" + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)) + ")")
    return out[:most] + ([f"and {len(out) - most} more"] if len(out) > most else [])


def short_value(value, width: int = 40) -> str:
    """A value as the ranks compare it in a mismatch message: its JSON, cut to `width` with a digest of the rest."""
    text = json.dumps(value, sort_keys=True, default=str)
    if len(text) <= width:
        return text
    return f"{text[: width - 12]}...#{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def prompt_details(prompt: dict) -> str:
    """JSON {"node N (Class) input 'name'": short value} of a ComfyUI API prompt, for `compare_fields`."""
    out = {}
    for node_id, node in prompt.items():
        cls = node.get("class_type", "?") if isinstance(node, dict) else "?"
        for name, value in (node.get("inputs") or {}).items() if isinstance(node, dict) else ():
            out[f"node {node_id} ({cls}) input '{name}'"] = short_value(value)
        out.setdefault(f"node {node_id} ({cls})", "present")
    return json.dumps(out, sort_keys=True)


def handshake(tp: TPGroup, fields: dict[str, str], what: str = "model") -> None:
    """Compare `fields` across ranks over the CPU group; raise RankMismatchError on every rank if any differs."""
    compare_fields(all_gather_object(dict(fields), tp), f"[tp2 r{tp.tp_rank}/{tp.tp_size}]", what)
    log.info("[tp2 r%d/%d] %s handshake ok (%s)", tp.tp_rank, tp.tp_size, what, ", ".join(f"{k}={v}" for k, v in sorted(fields.items())))
