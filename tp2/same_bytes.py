"""Tensors (and blobs) made byte-identical on every rank: a digest of the bytes, compared over the CPU group, and
rank src's bytes sent only where one differs (nodes/same_outputs.py uses it for what ranks compute alone).
Imports nothing from `comfy`.
"""

from __future__ import annotations

import hashlib

import torch

from .collectives import TPGroup, all_gather_object, broadcast_object, broadcast_tree
from .safetensors_io import ordered_map

DIGEST_PIECE_BYTES = 64 << 20


def bytes_digest(t: torch.Tensor) -> str:
    """SHA-256 of the SHA-256s of a tensor's bytes in memory order, 64 MiB a piece, the pieces hashed on threads
    (hashlib lets go of the GIL); no copy when the tensor's memory is dense in some dim order."""
    data = memoryview(_dense(t.detach())[0].cpu().reshape(-1).view(torch.uint8).numpy())
    pieces = [data[i : i + DIGEST_PIECE_BYTES] for i in range(0, len(data), DIGEST_PIECE_BYTES)]
    parts = ordered_map(lambda piece: hashlib.sha256(piece).digest(), pieces)
    return hashlib.sha256(b"".join(parts)).hexdigest()


def _dense(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(`t` with its dims in the order its memory holds them, whether that is a view of `t`'s own memory): a
    contiguous view where there is one (e.g. a movedim of a contiguous tensor), else a contiguous copy."""
    view = t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return (view, True) if view.is_contiguous() else (t.contiguous(), False)


def same_everywhere(t: torch.Tensor, tp: TPGroup, src: int = 0, piece_bytes: int = 256 << 20) -> list[int]:
    """Make `t` equal on every rank to rank `src`'s, bit for bit, in place; the ranks whose tensor differed from src's.
    Only the digests travel, unless one differs: then src's tensor, broadcast in pieces of at most `piece_bytes`."""
    differ = _differing(bytes_digest(t), tp, src)
    if not differ:
        return []
    dense, own_memory = _dense(t)
    flat = dense.reshape(-1)
    step = max(1, piece_bytes // t.element_size())
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step]
        got = broadcast_tree(piece if tp.tp_rank == src else None, tp, src)
        if tp.tp_rank != src:
            piece.copy_(got)
    if not own_memory:
        t.copy_(dense)
    return differ


def same_blob_everywhere(blob: bytes, tp: TPGroup, src: int = 0) -> tuple[bytes, list[int]]:
    """(rank src's `blob`, the ranks whose blob differed from it): the digests travel, the bytes only where one
    differs. Blobs may differ in length (e.g. two encoders' files)."""
    differ = _differing(hashlib.sha256(blob).hexdigest(), tp, src)
    if not differ:
        return blob, []
    return broadcast_object(blob if tp.tp_rank == src else None, tp, src), differ


def _differing(digest: str, tp: TPGroup, src: int) -> list[int]:
    digests = all_gather_object(digest, tp)
    return [r for r, d in enumerate(digests) if d != digests[src]]
