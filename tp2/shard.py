"""Cutting a checkpoint into per-rank pieces: in memory, straight from disk, or into pre-sharded rank files.

A rank reads only its slices (`shard_state_dict`), so it never holds the full checkpoint. The offline
pre-sharder writes one file per rank, streaming tensor by tensor, with the TP metadata in its header; a rank
file embeds the full checkpoint layout so that `verify_rank_file` can re-derive the plan and refuse a file
made for another rank, tp_size, plan or source, and a content digest per tensor that `load_rank_file` checks
(once per file: the check is remembered by path, size and mtime under TP2_CACHE_DIR, default
~/.cache/minimax-h3-tp2).

    python -m tp2.shard CKPT --tp-size N --out-dir DIR [--tp-rank R]

Imports nothing from `comfy`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time

import torch

from . import __version__
from .checked_files import remember_verified, verified_before
from .checkpoint import CheckpointLayout
from .errors import PlanError, ShardMismatchError, TP2Error
from .nvfp4 import slice_block_scales
from .plan import RANK0, SPLIT, Plan, TensorShard, resolve_plan
from .safetensors_io import (
    DTYPES,
    IO_WORKERS,
    PendingTensor,
    TensorReader,
    file_fingerprint,
    hashed_tensors,
    ordered_map,
    read_header,
    write_streaming,
)
from .te_plan import NVFP4_BLOCK_SCALE, nvfp4_logical_shape

log = logging.getLogger(__name__)

META_PREFIX = "tp2."  # every metadata key the sharder adds starts with it
META_RANK = "tp2.tp_rank"
META_SIZE = "tp2.tp_size"
META_PLAN = "tp2.plan"
META_SOURCE = "tp2.source"
META_SOURCE_NAME = "tp2.source_name"
META_LAYOUT = "tp2.full_layout"
META_VERSION = "tp2.version"
META_DIGESTS = "tp2.tensor_digests"  # {tensor: 64-bit BLAKE2b of its bytes}, checked at load (cached by path, size, mtime)


def local_ranges(ts: TensorShard, tp_rank: int, tp_size: int) -> list[tuple[int, int]]:
    """The [start, end) ranges of `ts.dim` that rank `tp_rank` holds, one per packed part, in order."""
    part = ts.full_shape[ts.dim] // ts.parts
    local = part // tp_size
    return [(p * part + tp_rank * local, p * part + (tp_rank + 1) * local) for p in range(ts.parts)]


def slice_tensor(full: torch.Tensor, ts: TensorShard, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank `tp_rank`'s copy of a tensor held in memory."""
    if ts.kind == SPLIT:
        pieces = [full.narrow(ts.dim, a, b - a) for a, b in local_ranges(ts, tp_rank, tp_size)]
        return torch.cat(pieces, dim=ts.dim).contiguous()
    if ts.kind == RANK0 and tp_rank != 0:
        return torch.zeros_like(full)
    return full


def unshard_tensor(pieces: list[torch.Tensor], ts: TensorShard) -> torch.Tensor:
    """Inverse of `slice_tensor` over all ranks (pieces in rank order)."""
    if ts.kind == SPLIT:
        per_part = [p.chunk(ts.parts, dim=ts.dim) for p in pieces]
        return torch.cat([chunks[i] for i in range(ts.parts) for chunks in per_part], dim=ts.dim)
    if ts.kind == RANK0:
        return torch.stack(pieces).sum(0).to(pieces[0].dtype)
    return pieces[0]


def read_local_tensor(reader: TensorReader, ts: TensorShard, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank `tp_rank`'s copy of a tensor, reading only its bytes from disk straight into the result."""
    if ts.kind == SPLIT:
        if ts.dim > 1:
            raise TP2Error(f"Tensor '{ts.name}' is split along dim {ts.dim}; only dims 0 and 1 can be read in slices.")
        out = torch.empty(ts.local_shape, dtype=DTYPES[ts.dtype])
        offset = 0
        for a, b in local_ranges(ts, tp_rank, tp_size):
            piece = out.narrow(ts.dim, offset, b - a)
            if ts.dim == 0:
                reader.read_rows(ts.name, a, b, out=piece)
            elif ts.parts == 1:
                reader.read_cols(ts.name, a, b, out=piece)
            else:
                piece.copy_(reader.read_cols(ts.name, a, b))
            offset += b - a
        return out
    if ts.kind == RANK0 and tp_rank != 0:
        return torch.zeros(ts.full_shape, dtype=DTYPES[ts.dtype])
    return reader.read(ts.name)


def check_rank(tp_rank: int, tp_size: int) -> None:
    if not 0 <= tp_rank < tp_size:
        raise TP2Error(f"tp_rank={tp_rank} is outside 0..{tp_size - 1} for tp_size={tp_size}. Set TP2_RANK below TP2_WORLD_SIZE.")


def shard_state_dict(path: str, tp_size: int, tp_rank: int) -> tuple[dict[str, torch.Tensor], dict[str, str], Plan]:
    """Shard-on-read: this rank's state dict, the file's metadata, and the plan (validated before any read)."""
    check_rank(tp_rank, tp_size)
    plan = resolve_plan(CheckpointLayout.from_file(path), tp_size)
    sd, metadata = read_shard(path, plan.tensors, tp_rank, tp_size, "")
    return sd, metadata, plan


def read_shard_tensor(reader: TensorReader, tensors: dict[str, TensorShard], name: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    """One tensor of a plan as this rank holds it. nvfp4 block scales are stored swizzled: each is read whole (1/8 of
    its weight's bytes) and re-cut in memory; everything else reads only this rank's bytes."""
    ts = tensors[name]
    if ts.kind == NVFP4_BLOCK_SCALE:
        n, k = nvfp4_logical_shape(tensors[name[: -len("_scale")]].full_shape)
        return slice_block_scales(reader.read(name), n, k, ts.dim, tp_rank, tp_size)
    return read_local_tensor(reader, ts, tp_rank, tp_size)


def read_shard(path: str, tensors: dict[str, TensorShard], tp_rank: int, tp_size: int, what: str) -> tuple[dict, dict[str, str]]:
    """Every tensor of a plan as this rank holds it, and the file's metadata."""
    t0 = time.monotonic()
    with TensorReader(path) as reader:
        names = list(tensors)  # read on IO_WORKERS threads at once
        sd = {n: t for t, n in zip(ordered_map(lambda n: read_shard_tensor(reader, tensors, n, tp_rank, tp_size), names), names)}
        metadata = dict(reader.header.metadata)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    log.info(
        "read %.2f GB%s for rank %d/%d from %s in %.1f s",
        nbytes / 1e9,
        what,
        tp_rank,
        tp_size,
        os.path.basename(path),
        time.monotonic() - t0,
    )
    return sd, metadata


def rank_file_name(source: str, tp_size: int, tp_rank: int) -> str:
    """The one naming rule for rank files: `<stem>.tp<N>-rank<R>.safetensors` next to the checkpoint."""
    stem = os.path.splitext(os.path.basename(source))[0]
    return f"{stem}.tp{tp_size}-rank{tp_rank}.safetensors"


_RANK_NAME = re.compile(r"\.tp(\d+)-rank(\d+)\.safetensors$")


def rank_file_sibling(path: str, tp_size: int, tp_rank: int) -> str | None:
    """For a rank file named by `rank_file_name`, the path of rank `tp_rank` of `tp_size` beside it; else None."""
    m = _RANK_NAME.search(path)
    return None if m is None else path[: m.start()] + f".tp{tp_size}-rank{tp_rank}.safetensors"


def without_pack_metadata(md: dict[str, str]) -> dict[str, str]:
    """The checkpoint's own metadata: a rank file's without the keys the sharder added."""
    return {k: v for k, v in md.items() if not k.startswith(META_PREFIX)}


def rank_file_for(path: str, tp_rank: int, tp_size: int) -> str | None:
    """The rank file to use: the chosen one's sibling for this rank, or `<stem>.tpN-rankR` next to a full file."""
    if is_rank_file(path):
        sibling = rank_file_sibling(path, tp_size, tp_rank)
        if sibling is None:
            verify_rank_file(path, tp_rank, tp_size)  # raises with the file's own rank/size if it is not ours
            return path
        if not os.path.exists(sibling):
            raise PlanError(
                f"'{os.path.basename(path)}' is a pre-sharded rank file; this rank ({tp_rank} of {tp_size}) needs "
                f"'{os.path.basename(sibling)}' next to it. Run `python -m tp2.shard CKPT --tp-size {tp_size}` for all ranks."
            )
        return sibling
    sibling = os.path.join(os.path.dirname(path), rank_file_name(path, tp_size, tp_rank))
    return sibling if os.path.exists(sibling) else None


def write_rank_file(source: str, out_dir: str, tp_size: int, tp_rank: int, progress=None) -> str:
    """Write rank `tp_rank`'s pre-sharded file into `out_dir`, streaming; returns its path."""
    check_rank(tp_rank, tp_size)
    layout = CheckpointLayout.from_file(source)
    plan = resolve_plan(layout, tp_size)
    header = read_header(source)
    metadata = dict(header.metadata)
    metadata.update(
        {
            META_RANK: str(tp_rank),
            META_SIZE: str(tp_size),
            META_PLAN: plan.fingerprint(),
            META_SOURCE: file_fingerprint(header),
            META_SOURCE_NAME: os.path.basename(source),
            META_LAYOUT: json.dumps(layout.to_json()["tensors"], separators=(",", ":")),
            META_VERSION: __version__,
        }
    )
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, rank_file_name(source, tp_size, tp_rank))
    with TensorReader(source) as reader:
        pending = [
            PendingTensor(ts.name, DTYPES[ts.dtype], ts.local_shape, lambda ts=ts: read_local_tensor(reader, ts, tp_rank, tp_size))
            for ts in plan.tensors.values()
        ]
        write_streaming(out, pending, metadata, progress, digests_key=META_DIGESTS, workers=IO_WORKERS)
    return out


def verify_rank_file(path: str, tp_rank: int, tp_size: int, expected_source: str | None = None) -> tuple[Plan, dict[str, str]]:
    """Check that `path` is rank `tp_rank` of `tp_size` of a consistent plan; return that plan and the metadata.

    Re-derives the plan from the full layout embedded in the file and checks its fingerprint and every local
    shape. `expected_source` (a `file_fingerprint`) also pins the checkpoint it was cut from.
    """
    header = read_header(path)
    md = header.metadata
    name = os.path.basename(path)
    if META_SIZE not in md:
        raise ShardMismatchError(
            f"'{name}' has no TP metadata: it is not a rank file made by `python -m tp2.shard`. Load the full checkpoint instead."
        )
    if (int(md[META_RANK]), int(md[META_SIZE])) != (tp_rank, tp_size):
        raise ShardMismatchError(
            f"'{name}' is rank {md[META_RANK]} of tp_size {md[META_SIZE]}, but this process is rank {tp_rank} of "
            f"{tp_size}. Give each rank its own file ({rank_file_name(md.get(META_SOURCE_NAME, name), tp_size, tp_rank)})."
        )
    if expected_source is not None and md[META_SOURCE] != expected_source:
        raise ShardMismatchError(
            f"'{name}' was cut from checkpoint {md[META_SOURCE]} ({md.get(META_SOURCE_NAME)}), not from the expected "
            f"{expected_source}. Re-run `python -m tp2.shard` on the checkpoint you mean to use."
        )
    if META_DIGESTS not in md:
        raise ShardMismatchError(
            f"'{name}' carries no content digests (made by pack {md.get(META_VERSION)}, before they were written): its "
            "data cannot be checked. Re-run `python -m tp2.shard` with this version of the pack."
        )
    full_md = without_pack_metadata(md)
    layout = CheckpointLayout(
        {n: (d, tuple(s)) for n, (d, s) in json.loads(md[META_LAYOUT]).items()}, full_md, {}, md.get(META_SOURCE_NAME, name)
    )
    plan = resolve_plan(layout, tp_size)
    if plan.fingerprint() != md[META_PLAN]:
        raise ShardMismatchError(
            f"'{name}' records plan {md[META_PLAN]} but this pack resolves plan {plan.fingerprint()} for its checkpoint "
            f"(pack {__version__}, file made by {md.get(META_VERSION)}). Re-shard with this version of the pack."
        )
    for tname, ts in plan.tensors.items():
        info = header.tensors.get(tname)
        if info is None or info.shape != ts.local_shape or info.dtype != ts.dtype:
            got = f"{info.dtype} {list(info.shape)}" if info else "missing"
            raise ShardMismatchError(
                f"'{name}': tensor '{tname}' is {got}, the plan wants {ts.dtype} {list(ts.local_shape)}. The rank file "
                "is damaged or was edited; re-run `python -m tp2.shard`."
            )
    return plan, dict(md)


def load_rank_file(
    path: str, tp_rank: int, tp_size: int, expected_source: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str], Plan]:
    """Verify, then read a pre-sharded rank file whole, checking every tensor against the digest the sharder wrote
    (skipped when this exact file, same size and mtime, was checked before: see `verified_before`)."""
    plan, md = verify_rank_file(path, tp_rank, tp_size, expected_source)
    digests = json.loads(md[META_DIGESTS])
    check = not verified_before(path, md[META_DIGESTS])
    t0 = time.monotonic()
    with TensorReader(path) as reader:
        sd = {}
        for n, t, digest in hashed_tensors(reader, list(plan.tensors), hashed=check):
            if check and digests.get(n) != digest:
                raise ShardMismatchError(
                    f"'{os.path.basename(path)}': the data of tensor '{n}' does not match the digest `python -m tp2.shard` "
                    "wrote: the file is damaged (disk, copy, download) or was edited. Re-run `python -m tp2.shard`."
                )
            sd[n] = t
    if check:
        remember_verified(path, md[META_DIGESTS])
        log.info("checked %d tensors of %s against their digests in %.1f s", len(sd), os.path.basename(path), time.monotonic() - t0)
    return sd, md, plan


def is_rank_file(path: str) -> bool:
    return META_SIZE in read_header(path).metadata


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tp2.shard", description="Write one pre-sharded H3 file per TP rank.")
    ap.add_argument("checkpoint")
    ap.add_argument("--tp-size", type=int, required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--tp-rank", type=int, help="write only this rank's file")
    args = ap.parse_args(argv)
    ranks = [args.tp_rank] if args.tp_rank is not None else list(range(args.tp_size))
    try:
        for r in ranks:
            t0 = time.monotonic()

            def progress(i: int, n: int, r: int = r) -> None:
                if i == n or i % max(1, n // 20) == 0:
                    print(f"\r  rank {r}: {i}/{n} tensors", end="", file=sys.stderr, flush=True)

            out = write_rank_file(args.checkpoint, args.out_dir, args.tp_size, r, progress)
            print(file=sys.stderr)
            print(f"{out}  ({os.path.getsize(out) / 1e9:.2f} GB, {time.monotonic() - t0:.1f} s)")
    except TP2Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
