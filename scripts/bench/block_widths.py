#!/usr/bin/env python3
"""Each rank's compute under a split, on one GPU: one full-size H3 DiT block (the one --split auto times,
scripts/lib/balance.py) at every rank's widths for a list of splits, as tp2.plan cuts the int8 release (heads in
ConvRot pairs, FFN in groups of 256), and its attention alone. The input of docs/PERFORMANCE.md's mixed-pair model.

    python scripts/bench/block_widths.py [--tokens 15100] [--splits 1:1,3:2,5:3,3:1]

JSON lines on stdout: split, rank, heads, ffn, block ms and attention ms (medians of 9). 15100 tokens: 832x480x124.
Run with the pack's folder on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SCRIPTS, "lib"))
from balance import H3_BLOCK, MEASUREMENTS, block_timer  # scripts/lib  # noqa: E402

from tp2.checkpoint import CheckpointLayout  # noqa: E402
from tp2.plan import resolve_plan  # noqa: E402
from tp2.split import parse_split  # noqa: E402

LAYOUT = os.path.join(os.path.dirname(SCRIPTS), "tests", "unit", "data", "h3_int8_convrot.layout.json")


def attention_ms(heads: int, tokens: int, head_dim: int) -> float:
    q, k, v = (torch.randn(1, heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    times = []
    for i in range(3 + MEASUREMENTS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        F.scaled_dot_product_attention(q, k, v)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=15100)
    ap.add_argument("--splits", default="1:1,3:2,5:3,3:1")
    a = ap.parse_args()
    with open(LAYOUT) as f:
        doc = json.load(f)
    layout = CheckpointLayout({n: (d, tuple(s)) for n, (d, s) in doc["tensors"].items()}, doc["metadata"], doc["quant"], doc["source"])
    for text in a.splits.split(","):
        shares = parse_split(text, len(text.split(":")))
        plan = resolve_plan(layout, len(shares), shares)
        for r in range(len(shares)):
            heads, ffn = plan.local_heads(r), plan.local_ffn(r)
            shape = H3_BLOCK.__class__(**{**H3_BLOCK.__dict__, "heads": heads, "ffn": ffn, "tokens": a.tokens})
            timer = block_timer(torch.device("cuda"), shape)
            block = statistics.median(timer() for _ in range(MEASUREMENTS)) * 1e3
            del timer
            torch.cuda.empty_cache()
            row = dict(split=text, rank=r, heads=heads, ffn=ffn, tokens=a.tokens, block_ms=round(block, 3))
            row["attention_ms"] = round(attention_ms(heads, a.tokens, H3_BLOCK.head_dim), 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
