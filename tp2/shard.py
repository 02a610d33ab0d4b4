"""Cutting a checkpoint into per-rank pieces, in memory or straight from disk (shard-on-read).

A rank reads only its slices (`read_shard`), so it never holds the full checkpoint; a packed tensor ([q|k|v], [gate|up]) gives each rank its
slice of each part, a row-parallel bias lives on rank 0 only, and the text encoder's nvfp4 block scales are cut in their swizzled layout
(tp2.nvfp4). The rank cache (tp2.rank_cache) writes what this reads into one file per rank. Imports nothing from `comfy`.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from .nvfp4 import nvfp4_logical_shape, slice_block_scales
from .plan import RANK0, SPLIT, TensorShard
from .safetensors_io import DTYPES, TensorReader, ordered_map
from .te_plan import NVFP4_BLOCK_SCALE

log = logging.getLogger(__name__)


def local_ranges(ts: TensorShard, tp_rank: int) -> list[tuple[int, int]]:
    """The [start, end) ranges of `ts.dim` that rank `tp_rank` holds, one per packed part, in order."""
    part = ts.full_shape[ts.dim] // ts.parts
    a, b = ts.bounds[tp_rank], ts.bounds[tp_rank + 1]
    return [(p * part + a, p * part + b) for p in range(ts.parts)]


def slice_tensor(full: torch.Tensor, ts: TensorShard, tp_rank: int) -> torch.Tensor:
    """Rank `tp_rank`'s copy of a tensor held in memory."""
    if ts.kind == SPLIT:
        return torch.cat([full.narrow(ts.dim, a, b - a) for a, b in local_ranges(ts, tp_rank)], dim=ts.dim).contiguous()
    if ts.kind == RANK0 and tp_rank != 0:
        return torch.zeros_like(full)
    return full


def read_shard_tensor(reader: TensorReader, tensors: dict[str, TensorShard], name: str, tp_rank: int) -> torch.Tensor:
    """One tensor of a plan as this rank holds it, reading only this rank's bytes straight into the result. nvfp4
    block scales are stored swizzled: each is read whole (1/8 of its weight's bytes) and re-cut in memory."""
    ts = tensors[name]
    if ts.kind == NVFP4_BLOCK_SCALE:
        n, k = nvfp4_logical_shape(tensors[name[: -len("_scale")]].full_shape)
        return slice_block_scales(reader.read(name), n, k, ts.dim, ts.bounds[tp_rank], ts.bounds[tp_rank + 1])
    if ts.kind != SPLIT:
        return slice_tensor(reader.read(name), ts, tp_rank)  # whole, or a rank-0-only bias (zeros on the other ranks)
    out = torch.empty(ts.local_shape(tp_rank), dtype=DTYPES[ts.dtype])
    read = reader.read_rows if ts.dim == 0 else reader.read_cols  # a plan splits dim 0 or 1
    offset = 0
    for a, b in local_ranges(ts, tp_rank):
        read(name, a, b, out=out.narrow(ts.dim, offset, b - a))
        offset += b - a
    return out


def read_shard(path: str, tensors: dict[str, TensorShard], tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """Every tensor of a plan as this rank holds it."""
    t0 = time.monotonic()
    with TensorReader(path) as reader:
        sd = dict(zip(tensors, ordered_map(lambda n: read_shard_tensor(reader, tensors, n, tp_rank), tensors)))
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    log.info("read %.2f GB for rank %d/%d from %s in %.1f s", nbytes / 1e9, tp_rank, tp_size, os.path.basename(path), time.monotonic() - t0)
    return sd
