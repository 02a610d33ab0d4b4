"""What a rank loads of a checkpoint, and the rank cache: this rank's slices of a checkpoint, cut once into a file under
TP2_CACHE_DIR, so the loader maps them from disk as it maps any checkpoint.

    shard = open_rank_shard(path, tp_rank, tp_size, cache_dir, read_all)   # the DiT (a rank file beside it wins)
    sd, metadata, origin = read_rank_slices(path, te_plan.tensors, te_plan.fingerprint(), tp_rank, tp_size, what,
                                            cache_dir, read_all)                # the text encoder

Why: ComfyUI's dynamic VRAM keeps a pinned host copy of every weight. A tensor mapped from a file fills that copy straight
from the file and nothing else is held; a tensor in ordinary memory (shard-on-read slices) is copied, and both copies stay
alive. From a rank-cache file a rank holds one copy. A cache file is named by the checkpoint's name and fingerprint, the
plan's fingerprint, this rank and tp_size; it carries a digest per tensor, computed as it is written and checked (a tensor
at a time, in a scratch buffer) on load after a change of its size or mtime (checks are remembered by path, size and
mtime). A file that fails the check is deleted and cut again; a disk without room leaves the rank on shard-on-read, with a
warning. Imports nothing from `comfy`: `read_all(path) -> state dict` is the loader's own file reader.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import __version__
from .checked_files import remember_verified, verified_before
from .checkpoint import CheckpointLayout
from .errors import ShardMismatchError
from .plan import Plan, TensorShard, resolve_plan
from .safetensors_io import (
    DTYPES,
    IO_WORKERS,
    PendingTensor,
    TensorReader,
    file_fingerprint,
    hashed_tensors,
    read_header,
    write_streaming,
)
from .shard import (
    META_DIGESTS,
    META_PLAN,
    META_RANK,
    META_SIZE,
    META_SOURCE,
    META_VERSION,
    check_rank,
    is_rank_file,
    load_rank_file,
    rank_file_for,
    read_shard,
    read_shard_tensor,
    without_pack_metadata,
)  # fmt: skip
from .te_plan import NVFP4_BLOCK_SCALE

log = logging.getLogger(__name__)

SPARE_BYTES = 2 << 30  # a cache file is written only if the disk keeps this much free after it
ReadAll = Callable[[str], dict[str, torch.Tensor]]


_CACHE_NAME = re.compile(r"(?P<stem>.+)\.[0-9a-f]{12}\.[0-9a-f]{12}(?P<tail>\.tp\d+-rank\d+\.safetensors)")


def cache_file(cache_dir: str, source: str, source_fp: str, plan_fp: str, tp_rank: int, tp_size: int) -> str:
    stem = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(cache_dir, "rank_cache", f"{stem}.{source_fp[:12]}.{plan_fp[:12]}.tp{tp_size}-rank{tp_rank}.safetensors")


def _remove_stale(out: str) -> None:
    """Delete this rank's cache files of an earlier version of the same checkpoint name (same rank and tp_size,
    another fingerprint or plan), and any half-written `.partial` of them or of `out` (a cut that was stopped): a
    replaced checkpoint or a stopped cut would otherwise leave gigabytes on disk for good, and count against the
    room for this cut."""
    folder, name = os.path.split(out)
    m = _CACHE_NAME.fullmatch(name)
    same = re.compile(re.escape(m["stem"]) + r"\.[0-9a-f]{12}\.[0-9a-f]{12}" + re.escape(m["tail"]) + r"(\.partial)?")
    for other in os.listdir(folder):
        if other != name and same.fullmatch(other):
            os.remove(os.path.join(folder, other))
            why = "a cut that was stopped before it ended" if other.endswith(".partial") else f"cut from an earlier version of {m['stem']}"
            log.info("rank cache: removed %s (%s)", other, why)


def _nbytes(tensors: dict[str, TensorShard]) -> int:
    return sum(torch.Size(ts.local_shape).numel() * DTYPES[ts.dtype].itemsize for ts in tensors.values())


def write_cache_file(out: str, source: str, tensors: dict[str, TensorShard], identity: dict[str, str], tp_rank: int, tp_size: int) -> bool:
    """Cut this rank's tensors from `source` into `out` (streaming, digests in the header); False if there is no room."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    _remove_stale(out)
    need, free = _nbytes(tensors), shutil.disk_usage(os.path.dirname(out)).free
    if free < need + SPARE_BYTES:
        log.warning(
            "rank cache: %.1f GB free in %s, %.1f GB needed for %s: this rank reads its slices from the checkpoint and "
            "holds them twice in host memory (free disk space or point TP2_CACHE_DIR elsewhere)",
            free / 1e9, os.path.dirname(out), need / 1e9, os.path.basename(out),
        )  # fmt: skip
        return False
    log.info("rank cache: cutting this rank's slices of %s into %s (%.1f GB, once)", os.path.basename(source), out, need / 1e9)
    t0 = time.monotonic()
    with TensorReader(source) as reader:
        # nvfp4 block scales: their local shape is known once cut (swizzle padding), so they are cut first and held
        scales = {n: read_shard_tensor(reader, tensors, n, tp_rank, tp_size) for n, ts in tensors.items() if ts.kind == NVFP4_BLOCK_SCALE}
        pending = [
            PendingTensor(n, scales[n].dtype, tuple(scales[n].shape), lambda n=n: scales.pop(n))
            if n in scales
            else PendingTensor(
                n, DTYPES[ts.dtype], tuple(ts.local_shape), lambda n=n: read_shard_tensor(reader, tensors, n, tp_rank, tp_size)
            )
            for n, ts in tensors.items()
        ]
        write_streaming(out, pending, {**identity, META_VERSION: __version__}, digests_key=META_DIGESTS, workers=IO_WORKERS)
    remember_verified(out, read_header(out).metadata[META_DIGESTS])  # hashed as written: the first load needs no re-read
    log.info("rank cache: wrote %s (%.2f GB) in %.1f s", out, need / 1e9, time.monotonic() - t0)
    return True


def load_cache_file(path: str, tensors: dict[str, TensorShard], identity: dict[str, str], read_all: ReadAll) -> dict[str, torch.Tensor]:
    """This rank's tensors from a cache file, checked against `identity` and, once per file, against its digests."""
    header = read_header(path)
    md, name = header.metadata, os.path.basename(path)
    wrong = {k: (md.get(k), v) for k, v in identity.items() if md.get(k) != v}
    if wrong or set(header.tensors) != set(tensors) or META_DIGESTS not in md:
        raise ShardMismatchError(f"rank cache file '{name}' is not this rank's cut of its checkpoint ({wrong or 'its tensors differ'})")
    for tname, ts in tensors.items():
        info = header.tensors[tname]
        if info.dtype != ts.dtype or (ts.kind != NVFP4_BLOCK_SCALE and tuple(info.shape) != tuple(ts.local_shape)):
            raise ShardMismatchError(
                f"rank cache file '{name}': tensor '{tname}' is {info.dtype} {list(info.shape)}, the plan wants {ts.dtype} {list(ts.local_shape)}"
            )
    if not verified_before(path, md[META_DIGESTS]):
        t0, digests = time.monotonic(), json.loads(md[META_DIGESTS])
        with TensorReader(path) as reader:
            for tname, _, digest in hashed_tensors(reader, list(tensors)):
                if digests.get(tname) != digest:
                    raise ShardMismatchError(
                        f"rank cache file '{name}': the data of tensor '{tname}' does not match its digest (the file is damaged)"
                    )
        remember_verified(path, md[META_DIGESTS])
        log.info("rank cache: checked %d tensors of %s against their digests in %.1f s", len(tensors), name, time.monotonic() - t0)
    sd = read_all(path)
    return {n: sd[n] for n in tensors}


def read_rank_slices(
    source: str, tensors: dict[str, TensorShard], plan_fp: str, tp_rank: int, tp_size: int, what: str,
    cache_dir: str | None = None, read_all: ReadAll | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:  # fmt: skip
    """This rank's tensors of `source` and the file's own metadata: at tp_size 1 the file itself through `read_all`;
    else from the rank cache when `cache_dir` is given (cut first if missing or damaged), else read from `source`
    (shard-on-read). The third value says which ("mapped whole", "rank cache FILE" or "shard-on-read")."""
    if tp_size == 1 and read_all is not None:  # nothing to cut: the file itself, mapped by the loader's reader
        sd = read_all(source)
        return {n: sd[n] for n in tensors}, dict(read_header(source).metadata), "mapped whole"
    if cache_dir is None or read_all is None:
        return (*read_shard(source, tensors, tp_rank, tp_size, what), "shard-on-read")
    header = read_header(source)
    identity = {META_RANK: str(tp_rank), META_SIZE: str(tp_size), META_PLAN: plan_fp, META_SOURCE: file_fingerprint(header)}
    path = cache_file(cache_dir, source, identity[META_SOURCE], plan_fp, tp_rank, tp_size)
    for attempt in (1, 2):
        if not os.path.exists(path) and not write_cache_file(path, source, tensors, identity, tp_rank, tp_size):
            break
        try:
            return load_cache_file(path, tensors, identity, read_all), dict(header.metadata), f"rank cache {os.path.basename(path)}"
        except ShardMismatchError as e:
            log.warning("%s: deleting it and %s", e, "cutting it again" if attempt == 1 else "reading from the checkpoint")
            os.remove(path)
    return (*read_shard(source, tensors, tp_rank, tp_size, what), "shard-on-read")


@dataclass(frozen=True)
class RankShard:
    """What a rank loads: its state dict, the checkpoint's own metadata, the plan, the source checkpoint's
    fingerprint, the pre-sharded file it came from (None: read from the full checkpoint), and where its tensors
    came from, in words (for the log)."""

    state_dict: dict[str, torch.Tensor]
    metadata: dict[str, str]
    plan: Plan
    source_fingerprint: str
    rank_file: str | None
    origin: str


def open_rank_shard(path: str, tp_rank: int, tp_size: int, cache_dir: str | None = None, read_all: ReadAll | None = None) -> RankShard:
    """This rank's shard of checkpoint `path`: from its pre-sharded file when one exists beside it (or `path` is one),
    checked against its digests and against `path`'s fingerprint; else this rank's slices of `path`, through the
    rank cache when `cache_dir` and `read_all` are given (tp2.rank_cache), else read from `path` (shard-on-read)."""
    rank_path = rank_file_for(path, tp_rank, tp_size)
    if rank_path is None:
        check_rank(tp_rank, tp_size)
        plan = resolve_plan(CheckpointLayout.from_file(path), tp_size)
        sd, metadata, origin = read_rank_slices(path, plan.tensors, plan.fingerprint(), tp_rank, tp_size, "", cache_dir, read_all)
        return RankShard(sd, metadata, plan, file_fingerprint(read_header(path)), None, origin)
    expected = None if is_rank_file(path) else file_fingerprint(read_header(path))
    sd, metadata, plan = load_rank_file(rank_path, tp_rank, tp_size, expected_source=expected)
    return RankShard(
        sd, without_pack_metadata(metadata), plan, metadata[META_SOURCE], rank_path, f"rank file {os.path.basename(rank_path)}"
    )
