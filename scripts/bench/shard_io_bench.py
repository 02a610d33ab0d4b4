#!/usr/bin/env python3
"""A rank's reads of a checkpoint with 1, 2, 4... I/O threads, side by side: shard-on-read (tp2.shard.read_shard),
cutting the rank-cache file (tp2.rank_cache.write_cache_file: read, hash, write) and checking a cache file's
digests (load_cache_file on a fresh verification record). Alternating per rep, from the page cache (the file is
read once first), rank 0 of tp_size 2.

    python scripts/bench/shard_io_bench.py CKPT [--workers 1,2,4] [--reps 2] [--tmp DIR]
    python scripts/make_tiny_h3.py /tmp/h3_6l.safetensors --full-size --int8 --layers 6    # a 3.2 GB stand-in

One JSON line per measurement on stdout.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import tp2.rank_cache as rank_cache  # noqa: E402
import tp2.safetensors_io as sio  # noqa: E402
import tp2.shard as shard  # noqa: E402
from tp2.checkpoint import CheckpointLayout  # noqa: E402
from tp2.plan import resolve_plan  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tmp", default=tempfile.gettempdir())
    a = ap.parse_args(argv)
    plan = resolve_plan(CheckpointLayout.from_file(a.ckpt), 2)
    nbytes = sum(rank_cache._nbytes({n: ts}) for n, ts in plan.tensors.items())
    with open(a.ckpt, "rb") as f:  # into the page cache, so every configuration reads from memory
        while f.read(64 << 20):
            pass
    identity = {"bench": "shard_io"}
    for rep in range(a.reps):
        for w in map(int, a.workers.split(",")):
            mapper = functools.partial(sio.ordered_map, workers=w)
            shard.ordered_map = rank_cache.ordered_map = mapper
            rank_cache.IO_WORKERS = w
            t0 = time.perf_counter()
            sd, _ = shard.read_shard(a.ckpt, plan.tensors, 0, 2, "")
            read_s = time.perf_counter() - t0
            del sd
            folder = tempfile.mkdtemp(dir=a.tmp)
            os.environ["TP2_CACHE_DIR"] = os.path.join(folder, "verified")
            out = rank_cache.cache_file(folder, a.ckpt, "0" * 12, "1" * 12, 0, 2)
            t0 = time.perf_counter()
            rank_cache.write_cache_file(out, a.ckpt, plan.tensors, identity, 0, 2)
            cut_s = time.perf_counter() - t0
            os.environ["TP2_CACHE_DIR"] = os.path.join(folder, "verified-again")  # the check is not remembered
            t0 = time.perf_counter()
            rank_cache.load_cache_file(out, plan.tensors, identity, lambda p: dict.fromkeys(plan.tensors))
            check_s = time.perf_counter() - t0
            shutil.rmtree(folder)
            print(json.dumps({"rep": rep, "workers": w, "rank_gb": round(nbytes / 1e9, 2), "shard_on_read_s": round(read_s, 2),
                              "cut_s": round(cut_s, 2), "digest_check_s": round(check_s, 2), "cpus": os.cpu_count()}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
