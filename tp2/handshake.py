"""What ranks compare before they run something together, and how a difference is told.

The fields are flat dicts of strings (`model_fingerprint`, `prompt_details`); tp2.session.agree gathers every
rank's over the store and `compare_fields` raises `RankMismatchError` on every rank, naming each field that
differs and each rank's value. Imports nothing from `comfy` (nor torch).
"""

from __future__ import annotations

import hashlib
import json

from . import __version__
from .errors import RankMismatchError
from .split import Shares, named


def model_fingerprint(plan_fingerprint: str, checkpoint_fingerprint: str, tp_size: int, shares: Shares = ()) -> dict[str, str]:
    """The fields ranks must share before they load and run a model (shares: the plan's; () the even split)."""
    fields = {"pack_version": __version__, "plan": plan_fingerprint, "checkpoint": checkpoint_fingerprint, "tp_size": str(tp_size)}
    return {**fields, "split": named(shares) if shares else "even"}


PRIVATE = "_tp2_"  # field-name prefix for the session's own bookkeeping (not compared)


def detail_key(field: str) -> str:
    """The field that explains `field` when ranks differ on it (JSON {label: short value}; not compared itself)."""
    return f"{PRIVATE}detail:{field}"


def compare_fields(everyone: list[dict[str, str]], tag: str, what: str) -> None:
    """Raise RankMismatchError naming every field that differs between ranks (in list order); a field with details
    (`detail_key(field)`, e.g. the prompt's nodes and inputs) is explained by the labels that differ: "node 5
    (KSampler) input 'seed' (rank 0: 1, rank 1: 2)". Different splits are told first, without the plans they make."""
    splits = [f.get("split", "even") for f in everyone]
    if len(set(splits)) > 1:
        raise RankMismatchError(
            f"{tag} ranks were started with different splits, so they cut the model differently: split "
            f"{', '.join(f'{s} on rank {r}' for r, s in enumerate(splits))}. Start every rank with the same --split (TP2_SPLIT)."
        )
    diffs = []
    for key, told in _differences(everyone, "'{}'", lambda k: not k.startswith(PRIVATE)):
        diffs.append(told)
        details = [f.get(detail_key(key)) for f in everyone]
        if None not in details:
            labels = [t for _, t in _differences([json.loads(d) for d in details])]
            diffs.extend(labels[:6] + ([f"and {len(labels) - 6} more"] if len(labels) > 6 else []))
    if diffs:
        raise RankMismatchError(
            f"{tag} ranks disagree on the {what}: {'; '.join(diffs)}. Every rank must run the same pack version, "
            "checkpoint, tp_size and workflow (graph, seeds, models, LoRAs): give all ranks the same files and prompt."
        )


def _differences(maps: list[dict], name: str = "{}", compared=lambda key: True) -> list[tuple[str, str]]:
    """(key, "<name> (rank 0: a, rank 1: b)") for each `compared` key whose value differs between the ranks' maps."""
    out = []
    for key in sorted({k for m in maps for k in m if compared(k)}):
        values = [m.get(key, "<missing>") for m in maps]
        if len(set(values)) > 1:
            out.append((key, name.format(key) + " (" + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)) + ")"))
    return out


def short_value(value, width: int = 40) -> str:
    """A value as the ranks compare it in a mismatch message: its JSON, cut to `width` with a digest of the rest."""
    text = json.dumps(value, sort_keys=True, default=str)
    if len(text) <= width:
        return text
    return f"{text[: width - 12]}...#{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def prompt_details(prompt: dict) -> str:
    """JSON {"node N (Class) input 'name'": short value, "node N (Class) key": short value} of a ComfyUI API prompt,
    for `compare_fields`: every input, and every other key of a node (e.g. its `_meta` title), by name."""
    out = {}
    for node_id, node in prompt.items():
        node = node if isinstance(node, dict) else {}
        cls = node.get("class_type", "?")
        for name, value in (node.get("inputs") or {}).items():
            out[f"node {node_id} ({cls}) input '{name}'"] = short_value(value)
        for key, value in node.items():
            if key not in ("inputs", "class_type"):
                out[f"node {node_id} ({cls}) {key}"] = short_value(value)
        out.setdefault(f"node {node_id} ({cls})", "present")
    return json.dumps(out, sort_keys=True)
