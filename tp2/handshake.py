"""The rank handshake: before the first tensor collective, ranks prove they agree on what they will run.

Each rank sends a flat dict of fingerprint fields over the CPU group; if any field differs, every rank raises
`RankMismatchError` naming the field and each rank's value. The same call compares per-prompt fingerprints.
Imports torch only (via `collectives`); never `comfy`.
"""

from __future__ import annotations

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


def compare_fields(everyone: list[dict[str, str]], tag: str, what: str, skip_prefix: str = "\0") -> None:
    """Raise RankMismatchError naming every field whose value differs between ranks (ranks in list order)."""
    diffs = []
    for key in sorted({k for f in everyone for k in f if not k.startswith(skip_prefix)}):
        values = [f.get(key, "<missing>") for f in everyone]
        if len(set(values)) > 1:
            diffs.append(f"'{key}' (" + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)) + ")")
    if diffs:
        raise RankMismatchError(
            f"{tag} ranks disagree on the {what}: {'; '.join(diffs)}. Every rank must run the same pack version, "
            "checkpoint, tp_size and workflow (graph, seeds, models, LoRAs): give all ranks the same files and prompt."
        )


def handshake(tp: TPGroup, fields: dict[str, str], what: str = "model") -> None:
    """Compare `fields` across ranks over the CPU group; raise RankMismatchError on every rank if any differs."""
    compare_fields(all_gather_object(dict(fields), tp), f"[tp2 r{tp.tp_rank}/{tp.tp_size}]", what)
    log.info("[tp2 r%d/%d] %s handshake ok (%s)", tp.tp_rank, tp.tp_size, what, ", ".join(f"{k}={v}" for k, v in sorted(fields.items())))
