"""The rank cache: this rank's slices of a checkpoint (the DiT or the text encoder), cut once into a file under
TP2_CACHE_DIR/rank_cache, so the loader maps them from disk as it maps any checkpoint: ComfyUI's dynamic VRAM then fills
its pinned host copy straight from the file instead of holding a second copy. `python -m tp2.rank_cache` cuts them ahead.

A cache file is named by the checkpoint's name and fingerprint, the plan's fingerprint, this rank and tp_size; its header
records them and a digest per tensor, checked whole once per size and mtime (recorded per machine by real path in
TP2_CACHE_DIR/verified_rank_files.json: a file damaged in place with both unchanged is not caught after that). A file
that fails a check or cannot be read is deleted with a warning and cut again; a disk without room leaves the rank on
shard-on-read. Imports nothing from `comfy`: `read_all(path) -> state dict` is the loader's own file reader.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import __version__, settings
from .checkpoint import CheckpointLayout
from .errors import CheckpointFormatError, ShardMismatchError, TP2Error
from .plan import Plan, TensorShard, resolve_plan
from .safetensors_io import DTYPES, IO_WORKERS, PendingTensor, TensorReader, file_fingerprint, hashed_tensors, read_header, write_streaming
from .shard import read_shard, read_shard_tensor
from .split import Shares, parse_split
from .te_plan import NVFP4_BLOCK_SCALE, TEPlan, is_h3_text_encoder, resolve_te_plan

log = logging.getLogger(__name__)

# a cache file's header records what it was cut from and for whom, and a digest per tensor (tp2.checkpoint's TP_METADATA_PREFIX)
META_RANK, META_SIZE, META_PLAN, META_SOURCE = "tp2.tp_rank", "tp2.tp_size", "tp2.plan", "tp2.source"
META_VERSION, META_DIGESTS = "tp2.version", "tp2.tensor_digests"  # {tensor: 64-bit BLAKE2b of its bytes}
VERIFIED_RECORD = "verified_rank_files.json"  # in TP2_CACHE_DIR: the cache files checked whole
SPARE_BYTES = 2 << 30  # a cache file is written only if the disk keeps this much free after it
# Tensors start at multiples of ALIGN bytes in a cache file, as in memory: a CPU BLAS may round a product by where its
# operands start, so mapped slices compute what read ones do.
ALIGN = 64
ReadAll = Callable[[str], dict[str, torch.Tensor]]


def _cache_entry(cache_dir: str, source: str, plan: Plan | TEPlan, tp_rank: int) -> tuple[str, dict[str, str]]:
    """The one naming rule (path of rank `tp_rank`'s cut of `source`) and the identity its header must record."""
    source_fp, plan_fp, tp_size = file_fingerprint(read_header(source)), plan.fingerprint(), plan.tp_size
    stem = os.path.splitext(os.path.basename(source))[0]
    name = f"{stem}.{source_fp[:12]}.{plan_fp[:12]}.tp{tp_size}-rank{tp_rank}.safetensors"
    identity = {META_RANK: str(tp_rank), META_SIZE: str(tp_size), META_PLAN: plan_fp, META_SOURCE: source_fp}
    return os.path.join(cache_dir, "rank_cache", name), identity


def _remove_stale(out: str) -> None:
    """Delete this rank's cache files cut from an earlier version of the same checkpoint, and stopped cuts (`.partial`)."""
    folder, name = os.path.split(out)
    m = re.fullmatch(r"(?P<stem>.+)\.[0-9a-f]{12}\.[0-9a-f]{12}(?P<tail>\.tp\d+-rank\d+\.safetensors)", name)
    same = re.compile(re.escape(m["stem"]) + r"\.[0-9a-f]{12}\.[0-9a-f]{12}" + re.escape(m["tail"]) + r"(\.partial)?")
    for other in os.listdir(folder):
        if other != name and same.fullmatch(other):
            os.remove(os.path.join(folder, other))
            why = "a cut that was stopped before it ended" if other.endswith(".partial") else f"cut from an earlier version of {m['stem']}"
            log.info("rank cache: removed %s (%s)", other, why)


def _file_key(path: str, digests: str) -> str:
    st = os.stat(path)
    return json.dumps([os.path.realpath(path), st.st_size, st.st_mtime_ns, hashlib.sha256(digests.encode()).hexdigest()[:16]])


def verified_before(path: str, digests: str) -> bool:
    """Whether this file, at this size and mtime and with these digests, was checked whole before."""
    try:
        with open(os.path.join(settings.cache_dir(), VERIFIED_RECORD)) as f:
            return _file_key(path, digests) in json.load(f)
    except (OSError, ValueError):
        return False


def remember_verified(path: str, digests: str) -> None:
    """Record that `path` was checked whole. The ranks of one machine share the record: the read, update and
    replace run under an exclusive lock on `<record>.lock`, so two ranks recording at once both stay recorded."""
    cache = os.path.join(settings.cache_dir(), VERIFIED_RECORD)
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        with open(cache + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with open(cache) as f:
                    known = [k for k in json.load(f) if json.loads(k)[0] != os.path.realpath(path)]
            except (OSError, ValueError):
                known = []
            tmp = f"{cache}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump([*known[-200:], _file_key(path, digests)], f)
            os.replace(tmp, cache)
    except OSError as e:  # a read-only home: the file is simply checked again next time
        log.warning("could not record that %s was checked (%s)", path, e)


def write_cache_file(out: str, source: str, tensors: dict[str, TensorShard], identity: dict[str, str], tp_rank: int, progress=None) -> bool:
    """Cut this rank's tensors from `source` into `out` (streaming, digests in the header); False if there is no room."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    _remove_stale(out)
    need = sum(math.prod(ts.local_shape(tp_rank)) * DTYPES[ts.dtype].itemsize for ts in tensors.values())
    free = shutil.disk_usage(os.path.dirname(out)).free
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
        read = functools.partial(read_shard_tensor, reader, tensors, tp_rank=tp_rank)
        # nvfp4 block scales: their local shape is known once cut (swizzle padding), so they are cut first and held
        scales = {n: read(n) for n, ts in tensors.items() if ts.kind == NVFP4_BLOCK_SCALE}
        pending = [
            PendingTensor(n, scales[n].dtype, tuple(scales[n].shape), lambda n=n: scales.pop(n))
            if n in scales
            else PendingTensor(n, DTYPES[ts.dtype], tuple(ts.local_shape(tp_rank)), functools.partial(read, n))
            for n, ts in tensors.items()
        ]
        pending.sort(key=lambda t: math.prod(t.shape) * t.dtype.itemsize % ALIGN != 0)  # whole-ALIGN tensors first
        metadata = {**identity, META_VERSION: __version__}
        try:
            write_streaming(out, pending, metadata, progress=progress, digests_key=META_DIGESTS, workers=IO_WORKERS, align=ALIGN)
        except OSError as e:  # the disk filled while cutting (the part written is removed): as no room at all
            log.warning("rank cache: writing %s failed (%s): this rank reads its slices from the checkpoint", out, e)
            return False
    remember_verified(out, read_header(out).metadata[META_DIGESTS])  # hashed as written: the first load needs no re-read
    log.info("rank cache: wrote %s (%.2f GB) in %.1f s", out, need / 1e9, time.monotonic() - t0)
    return True


def load_cache_file(
    path: str, tensors: dict[str, TensorShard], identity: dict[str, str], read_all: ReadAll, tp_rank: int
) -> dict[str, torch.Tensor]:
    """This rank's tensors from a cache file, checked against `identity` and, once per file, against its digests."""
    header = read_header(path)
    md, name = header.metadata, os.path.basename(path)
    wrong = {k: (md.get(k), v) for k, v in identity.items() if md.get(k) != v}
    if wrong or set(header.tensors) != set(tensors) or META_DIGESTS not in md:
        raise ShardMismatchError(f"rank cache file '{name}' is not this rank's cut of its checkpoint ({wrong or 'its tensors differ'})")
    for tname, ts in tensors.items():
        info = header.tensors[tname]
        if info.dtype != ts.dtype or (ts.kind != NVFP4_BLOCK_SCALE and tuple(info.shape) != tuple(ts.local_shape(tp_rank))):
            raise ShardMismatchError(
                f"rank cache file '{name}': tensor '{tname}' is {info.dtype} {list(info.shape)}, the plan wants {ts.dtype} {list(ts.local_shape(tp_rank))}"
            )
    if not verified_before(path, md[META_DIGESTS]):
        t0, digests = time.monotonic(), json.loads(md[META_DIGESTS])
        with TensorReader(path) as reader:
            for tname, digest in hashed_tensors(reader, list(tensors)):
                if digests.get(tname) != digest:
                    raise ShardMismatchError(
                        f"rank cache file '{name}': the data of tensor '{tname}' does not match its digest (the file is damaged)"
                    )
        remember_verified(path, md[META_DIGESTS])
        log.info("rank cache: checked %d tensors of %s against their digests in %.1f s", len(tensors), name, time.monotonic() - t0)
    sd = read_all(path)
    return {n: sd[n] for n in tensors}


@dataclass(frozen=True)
class RankShard:
    """What a rank loads, and where its tensors came from in words (`origin`: for the log and the status node)."""

    state_dict: dict[str, torch.Tensor]
    metadata: dict[str, str]  # the checkpoint's own
    plan: Plan | TEPlan
    source_fingerprint: str
    origin: str  # "mapped whole", "rank cache FILE" or "shard-on-read"


def _plan(source: str, tp_rank: int, tp_size: int, shares: Shares | None) -> Plan | TEPlan:
    """The plan of H3 DiT or text encoder checkpoint `source` (shares None: the even split), read from its header."""
    if not 0 <= tp_rank < tp_size:
        raise TP2Error(f"tp_rank={tp_rank} is outside 0..{tp_size - 1} for tp_size={tp_size}. Set TP2_RANK below TP2_WORLD_SIZE.")
    layout = CheckpointLayout.from_file(source)
    return resolve_te_plan(layout, tp_size, shares) if is_h3_text_encoder(layout) else resolve_plan(layout, tp_size, shares)


def open_rank_shard(
    path: str, tp_rank: int, tp_size: int, cache_dir: str | None = None, read_all: ReadAll | None = None, cut: bool = True,
    shares: Shares | None = None,
) -> RankShard:  # fmt: skip
    """This rank's shard of H3 DiT or text encoder checkpoint `path`, planned before a byte of weights is read: at
    tp_size 1 the file itself through `read_all`; else from the rank cache when `cache_dir` and `read_all` are given
    (cut first if missing or damaged, when `cut`), else read from `path` (shard-on-read)."""
    plan = _plan(path, tp_rank, tp_size, shares)
    header = read_header(path)
    shard = functools.partial(RankShard, metadata=dict(header.metadata), plan=plan, source_fingerprint=file_fingerprint(header))
    if tp_size == 1 and read_all is not None:  # nothing to cut: the file itself, mapped by the loader's reader
        sd = read_all(path)
        return shard({n: sd[n] for n in plan.tensors}, origin="mapped whole")
    if cache_dir is not None and read_all is not None:
        cache, identity = _cache_entry(cache_dir, path, plan, tp_rank)
        for attempt in (1, 2):
            if not os.path.exists(cache) and not (cut and write_cache_file(cache, path, plan.tensors, identity, tp_rank)):
                break
            try:
                sd = load_cache_file(cache, plan.tensors, identity, read_all, tp_rank)
                return shard(sd, origin=f"rank cache {os.path.basename(cache)}")
            except (ShardMismatchError, CheckpointFormatError, OSError) as e:  # as a digest mismatch: never the checkpoint's fault
                then = "cutting it again" if attempt == 1 and cut else "reading from the checkpoint"
                log.warning("rank cache file %s cannot be used (%s): deleting it and %s", cache, e, then)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(cache)
    return shard(read_shard(path, plan.tensors, tp_rank, tp_size), origin="shard-on-read")


def cut_ahead(source: str, tp_size: int, tp_rank: int, cache_dir: str, progress=None, shares: Shares | None = None) -> str:
    """Cut rank `tp_rank`'s slices of `source` (an H3 DiT or text encoder) into the rank cache now; returns the path."""
    if tp_size == 1:
        raise TP2Error("tp_size 1 maps the checkpoint whole: there is nothing to cut. Use the tp_size you start with.")
    plan = _plan(source, tp_rank, tp_size, shares)
    path, identity = _cache_entry(cache_dir, source, plan, tp_rank)
    if not write_cache_file(path, source, plan.tensors, identity, tp_rank, progress):
        raise TP2Error(f"not enough free disk in {os.path.dirname(path)} for {os.path.basename(path)} (see the warning above)")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tp2.rank_cache",
        description="Cut each rank's slices of an H3 DiT or text encoder into the rank cache now, so no rank cuts them at its first load.",
    )
    ap.add_argument("checkpoint")
    ap.add_argument("--tp-size", type=int, required=True)
    ap.add_argument("--tp-rank", type=int, help="cut only this rank's slices")
    ap.add_argument("--split", default=None, help="the ranks' shares, as the launcher's --split (e.g. 3:2; default even)")
    ap.add_argument("--cache-dir", default=None, help="TP2_CACHE_DIR of the ranks (default: as the ranks resolve it)")
    args = ap.parse_args(argv)
    cache_dir = args.cache_dir or settings.cache_dir()
    try:
        for r in [args.tp_rank] if args.tp_rank is not None else range(args.tp_size):
            t0 = time.monotonic()

            def progress(i: int, n: int, r: int = r) -> None:
                if i == n or i % max(1, n // 20) == 0:
                    print(f"\r  rank {r}: {i}/{n} tensors", end="", file=sys.stderr, flush=True)

            out = cut_ahead(args.checkpoint, args.tp_size, r, cache_dir, progress, parse_split(args.split, args.tp_size))
            print(file=sys.stderr)
            print(f"{out}  ({os.path.getsize(out) / 1e9:.2f} GB, {time.monotonic() - t0:.1f} s)")
    except TP2Error as e:
        print(f"\nerror: {e}", file=sys.stderr)  # after a progress line
        return 2
    except OSError as e:  # a disk that fills while cutting (ENOSPC), a folder it cannot write: one line, no traceback
        print(f"\nerror: cutting into {cache_dir} failed: {e} (free space there, or choose another with --cache-dir)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
