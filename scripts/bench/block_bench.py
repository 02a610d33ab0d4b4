#!/usr/bin/env python3
"""Block-level microbenchmark of the TP core (no ComfyUI): one full-size H3 DiT block with random int8 ConvRot
weights, TP1 in one process and TP2 over NCCL in two, side by side; per part and for the whole block.

    python scripts/bench/block_bench.py [--tokens 14880] [--reps 20] [--out DIR]

Parts: the int8 GEMMs (qkv, out_proj, fc1, fc2+swiglu; comfy-kitchen through kernels.select_int8_gemm),
attention (torch SDPA bf16, and comfy-kitchen int8 when available), the all-reduce of one row-parallel output
(fp32 and bf16), the replicated elementwise work (2 RMSNorms, 2 modulations, 2 gated residuals) and the block
as the pack runs it. Times are CUDA-event medians after warm-up, in ms; rank 0's numbers are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch.distributed as dist
import torch.multiprocessing as mp
from cuda_timing import timed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HIDDEN, HEADS, HEAD_DIM, FFN, GROUP = 5376, 56, 128, 14336, 256


def int8_weight(rows: int, cols: int, gen: torch.Generator):
    from tp2.layers import Int8Weight

    q = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8).cuda()
    return Int8Weight(q, torch.full((rows, 1), 1.0 / (73.3 * cols**0.5), device="cuda"), GROUP)


def rms(x, eps=1e-5):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


def run(tp_rank: int, tp_size: int, port: int, args, queue) -> None:
    sys.path.insert(0, ROOT)
    from kernels import select_int8_gemm
    from tp2.collectives import TPEnv, all_reduce, init_tp_group, single_rank_group
    from tp2.layers import ColumnParallelLinear, RowParallelLinear

    torch.cuda.set_device(tp_rank)
    tp = (
        init_tp_group(TPEnv(tp_rank, tp_size, "127.0.0.1", port, 120.0), torch.device("cuda", tp_rank))
        if tp_size > 1
        else single_rank_group(torch.device("cuda"))
    )
    gemm = select_int8_gemm()
    gen = torch.Generator().manual_seed(tp_rank)
    s, heads = args.tokens, HEADS // tp_size
    inner, ffn = heads * HEAD_DIM, FFN // tp_size
    qkv = ColumnParallelLinear(int8_weight(3 * inner, HIDDEN, gen), None, tp, gemm)
    out = RowParallelLinear(int8_weight(HIDDEN, inner, gen), None, tp, gemm)
    fc1 = ColumnParallelLinear(int8_weight(2 * ffn, HIDDEN, gen), None, tp, gemm)
    fc2 = RowParallelLinear(int8_weight(HIDDEN, ffn, gen), None, tp, gemm)
    x = torch.randn(s, HIDDEN, device="cuda", dtype=torch.bfloat16)
    mod = torch.randn(6, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.1
    att_in = torch.randn(s, inner, device="cuda", dtype=torch.bfloat16)
    fc1_out = torch.randn(s, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, heads, s, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    partial = torch.randn(s, HIDDEN, device="cuda")

    def elementwise():
        h = rms(x) * (1 + mod[1]) + mod[0]
        y = x.float().addcmul_(h.float(), mod[2].float())
        h = rms(y.to(torch.bfloat16)) * (1 + mod[4]) + mod[3]
        return y.addcmul_(h.float(), mod[5].float())

    def attention():
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    def block():
        h = rms(x) * (1 + mod[1]) + mod[0]
        a, k, v = qkv(h).chunk(3, dim=-1)
        att = torch.nn.functional.scaled_dot_product_attention(
            a.view(1, s, heads, HEAD_DIM).transpose(1, 2),
            k.view(1, s, heads, HEAD_DIM).transpose(1, 2),
            v.view(1, s, heads, HEAD_DIM).transpose(1, 2),
        )
        y = x.float().addcmul_(out(att.transpose(1, 2).reshape(s, inner)).float(), mod[2].float())
        h = rms(y.to(torch.bfloat16)) * (1 + mod[4]) + mod[3]
        return y.addcmul_(fc2(fc1(h), input_act="swiglu").float(), mod[5].float())

    parts = {
        "qkv GEMM": lambda: qkv(x),
        "attention sdpa bf16": attention,
        "out_proj GEMM+reduce": lambda: out(att_in),
        "fc1 GEMM": lambda: fc1(x),
        "fc2 swiglu GEMM+reduce": lambda: fc2(fc1_out, input_act="swiglu"),
        "elementwise (replicated)": elementwise,
        "block": block,
    }
    try:
        import comfy_kitchen as ck

        if ck.int8_attention_is_available():
            parts["attention ck int8"] = lambda: ck.int8_attention(q, q, q)
    except Exception:  # noqa: BLE001 - optional
        pass
    if tp_size > 1:
        parts["all_reduce fp32 [S,5376]"] = lambda: all_reduce(partial, tp)
        bf = partial.to(torch.bfloat16)
        parts["all_reduce bf16 [S,5376]"] = lambda: all_reduce(bf, tp)
    results = {name: timed(fn, args.reps) for name, fn in parts.items()}
    if tp_rank == 0:
        queue.put((tp_size, results))
    if tp_size > 1:
        dist.barrier()
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=14880, help="sequence length S (14880 = 832x480x124 with text)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    table = {}
    for tp_size in (1, 2):
        if torch.cuda.device_count() < tp_size:
            continue
        port = 29600 + tp_size
        procs = [ctx.Process(target=run, args=(r, tp_size, port, args, queue)) for r in range(tp_size)]
        for p in procs:
            p.start()
        size, results = queue.get(timeout=600)
        for p in procs:
            p.join(120)
        table[size] = results
    names = list(dict.fromkeys(n for r in table.values() for n in r))
    print(f"| part (S={args.tokens}), ms | " + " | ".join(f"TP{t}" for t in table) + " | TP1/TP2 |")
    print("|---|" + "---|" * (len(table) + 1))
    for n in names:
        vals = [table[t].get(n) for t in table]
        ratio = f"{vals[0] / vals[1]:.2f}x" if len(vals) == 2 and all(vals) else "-"
        print(f"| {n} | " + " | ".join(f"{v:.2f}" if v else "-" for v in vals) + f" | {ratio} |")
    with open(os.path.join(args.out, f"block_bench_S{args.tokens}.json"), "w") as f:
        json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
