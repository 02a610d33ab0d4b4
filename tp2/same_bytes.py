"""Tensors (and blobs) made byte-identical on every rank: a digest of the bytes, compared over the CPU group, and
rank src's bytes sent only where one differs (nodes/same_outputs.py uses it for what ranks compute alone).
Imports nothing from `comfy`.
"""

from __future__ import annotations

import hashlib
import math

import torch

from .collectives import TPGroup, all_gather_object, broadcast_object, broadcast_tree
from .safetensors_io import ordered_map

DIGEST_PIECE_BYTES = 64 << 20


def bytes_digest(t: torch.Tensor) -> str:
    """SHA-256 of the SHA-256s of a tensor's bytes in row-major order, so equal tensors digest alike whatever their
    strides; in pieces of at most 64 MiB (_pieces), hashed on threads (hashlib lets go of the GIL), each copied only
    where it is not contiguous."""
    parts = ordered_map(lambda p: hashlib.sha256(_bytes(p)).digest(), _pieces(t.detach().cpu(), DIGEST_PIECE_BYTES))
    return hashlib.sha256(b"".join(parts)).hexdigest()


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _pieces(t: torch.Tensor, piece_bytes: int) -> list[torch.Tensor]:
    """Views of `t` that, one after another, are `t` in row-major order, each at most `piece_bytes` (or one element):
    cut by the shape alone, so two ranks cut equal tensors alike whatever their strides."""
    if t.dim() == 0:
        return [t.reshape(1)]
    row = math.prod(t.shape[1:]) * t.element_size()
    if t.dim() == 1 or row <= piece_bytes:
        return list(t.split(max(1, piece_bytes // max(row, 1)), dim=0))
    return [p for sub in t.unbind(0) for p in _pieces(sub, piece_bytes)]


def same_everywhere(t: torch.Tensor, tp: TPGroup, src: int = 0, piece_bytes: int = 256 << 20) -> list[int]:
    """Make `t` equal on every rank to rank `src`'s, bit for bit, in place; the ranks whose tensor differed from src's.
    Only the digests travel, unless one differs: then src's tensor, broadcast in row-major pieces of at most
    `piece_bytes` (received in place where a piece is contiguous), whatever each rank's strides."""
    differ = _differing(bytes_digest(t), tp, src)
    if not differ:
        return []
    for piece in _pieces(t, piece_bytes):
        got = broadcast_tree(piece, tp, src)
        if tp.tp_rank != src and got is not piece:
            piece.copy_(got)
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
