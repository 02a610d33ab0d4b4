"""The launcher's `--split auto` (scripts/start-tp2.sh, before any rank starts): measure each rank's device, one at a
time, and print the shares tp2.balance.auto_shares chooses.

    balance.py CPU GPU...       CPU "1": a test run on the CPU (one GPU index per rank is still given: 0..tp_size-1)

Per device: its free memory (torch.cuda.mem_get_info; none on a CPU), and the median time of one MiniMax-H3-shaped
DiT block's main work at full width: the four big linears as int8 ConvRot weights through the pack's own GEMM
(kernels.select_int8_gemm, TP2_INT8_KERNEL) and SDPA over the heads, 4096 tokens in bf16. On the CPU a block 16x
narrower, 256 tokens, float32, F.linear. Stdout: only the shares (e.g. 17:11); stderr: the measurements, the
decision, the link between the ranks (one process per rank, timed as the ranks time it) and the speed-up that
docs/PERFORMANCE.md's model of a pair predicts from them (tp2/link.py). Exit 1 with a one-line reason when it cannot
measure. Run with the pack's folder on PYTHONPATH.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from tp2 import settings
from tp2.balance import CPU_BLOCK, H3_BLOCK, BlockShape, auto_split, describe_auto
from tp2.link import predict_speedup, verdict
from tp2.split import even
from tp2.wire import EXACT, INT8, WIRE_BYTES

WARMUP, MEASUREMENTS = 3, 9
COMPRESS_GAIN = 1.1  # check picks the int8 wire where the model predicts it at least this much faster than exact


def block_weights(shape: BlockShape, device, dtype):
    """qkv, out_proj, fc1 (gate | up), fc2 at `shape`'s widths: Int8Weight (ConvRot) on a GPU, float on the CPU."""
    import torch

    from kernels.int8_gemm import quantize_int8_convrot
    from tp2.layers import Int8Weight

    width = shape.heads * shape.head_dim
    sizes = {"qkv": (3 * width, shape.hidden), "out": (shape.hidden, width)}
    sizes |= {"fc1": (2 * shape.ffn, shape.hidden), "fc2": (shape.hidden, shape.ffn)}
    weights = {}
    for name, (n, k) in sizes.items():
        w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
        weights[name] = Int8Weight(*quantize_int8_convrot(w), convrot_group=256) if shape.int8 else w
    return weights


def attend(shape: BlockShape, x, weights, gemm):
    """qkv, then SDPA over the heads: out_proj's input [tokens, heads x head_dim]."""
    import torch.nn.functional as F

    from tp2.layers import local_linear

    q, k, v = local_linear(x, weights["qkv"], None, x.dtype, gemm).view(shape.tokens, 3, shape.heads, shape.head_dim).unbind(1)
    heads = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    return F.scaled_dot_product_attention(*heads).squeeze(0).transpose(0, 1).reshape(shape.tokens, -1)


def run_block(shape: BlockShape, x, weights, gemm) -> None:
    """One block's main work: qkv, attention over the heads, out_proj; fc1, swiglu fused into fc2."""
    from tp2.layers import local_linear

    local_linear(attend(shape, x, weights, gemm), weights["out"], None, x.dtype, gemm)
    local_linear(local_linear(x, weights["fc1"], None, x.dtype, gemm), weights["fc2"], None, x.dtype, gemm, "swiglu")


def block_timer(device, shape: BlockShape):
    """A timer of `shape`'s block on `device` (weights made, WARMUP blocks run): timer() -> seconds for one block."""
    import torch

    dtype = torch.bfloat16 if shape.int8 else torch.float32
    gemm = None
    if shape.int8:
        from kernels import select_int8_gemm

        gemm = select_int8_gemm(settings.value("TP2_INT8_KERNEL"))
    weights = block_weights(shape, device, dtype)
    x = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(WARMUP):
        run_block(shape, x, weights, gemm)

    def timer() -> float:
        sync()
        start = time.perf_counter()
        run_block(shape, x, weights, gemm)
        sync()
        return time.perf_counter() - start

    return timer


def measure(cpu: bool, gpus: list[str]) -> tuple[list[str], list[list[float]], list[float | None]]:
    """(device names, block seconds (MEASUREMENTS of them), free GiB) per rank. GPUs one after another, memory freed between; on the
    CPU (tests) the ranks' measurements take turns, so a change in the machine's load meets every rank alike."""
    import torch

    if cpu:
        torch.set_num_threads(1)  # steadier beside other work on a shared CPU
        timer = block_timer(torch.device("cpu"), CPU_BLOCK)
        rounds = [[timer() for _ in gpus] for _ in range(MEASUREMENTS)]
        return ["cpu"] * len(gpus), [list(rank) for rank in zip(*rounds)], [None] * len(gpus)
    names, seconds, free = [], [], []
    visible = list(dict.fromkeys(gpus))  # a GPU ranks share is made visible once; its free memory is divided among them
    for gpu in gpus:
        device = torch.device("cuda", visible.index(gpu))
        names.append(f"GPU {gpu} ({torch.cuda.get_device_name(device)})")
        free.append(torch.cuda.mem_get_info(device)[0] / 2**30 / gpus.count(gpu))
        timer = block_timer(device, H3_BLOCK)
        seconds.append([timer() for _ in range(MEASUREMENTS)])
        del timer  # its weights
        torch.cuda.empty_cache()
    return names, seconds, free


def _link_rank(tp_rank: int, gpus: list[str], port: int, results) -> None:
    """One process of measure_link_between: its GPU alone visible (as a rank's), the group formed, the link timed."""
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[tp_rank]  # before CUDA starts in this process
    import torch

    from tp2.collectives import init_tp_group
    from tp2.link import measure_link
    from tp2.settings import TPEnv

    cuda = bool(gpus[tp_rank])
    if cuda:
        torch.cuda.set_device(0)
    env = TPEnv(tp_rank, len(gpus), "127.0.0.1", port, 60.0)
    try:
        link = measure_link(init_tp_group(env, torch.device("cuda", 0) if cuda else torch.device("cpu")), gpus[tp_rank])
        results.put((tp_rank, link))
    except Exception as e:  # the parent reports it
        results.put((tp_rank, f"{type(e).__name__}: {e}"))


def measure_link_between(cpu: bool, gpus: list[str]):
    """tp2.link.Link between one process per rank (gloo on the CPU, NCCL on the GPUs), as the ranks measure it."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results, procs = ctx.Queue(), []
    for r in range(len(gpus)):
        procs.append(ctx.Process(target=_link_rank, args=(r, [""] * len(gpus) if cpu else gpus, port, results), daemon=True))
        procs[-1].start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(10)
    if not all(hasattr(v, "bus_gbps") for v in got.values()):
        raise RuntimeError(f"the link between the ranks could not be measured: {got}")
    return got[0]


def speed_lines(block_s: list[float], auto, link, chosen, cpu: bool) -> list[str]:
    """Each wire's predicted speed-up at the even split and the one picked (TP2_WIRE if set, else int8 where the model
    gives it COMPRESS_GAIN over exact; the launcher itself picks by the link's kind), then the speed-up through it at the even split, --split auto's shares and `chosen`."""
    shape, dtype, n = CPU_BLOCK if cpu else H3_BLOCK, settings.value("TP2_REDUCE_DTYPE"), len(block_s)

    def predict(shares, wire: str) -> tuple[float, float]:
        return predict_speedup(block_s, shares, link.bus_gbps, shape.tokens, shape.hidden, WIRE_BYTES[dtype if wire == EXACT else wire])

    wires = {w: predict(even(n), w)[0] for w in (EXACT, INT8)}
    yours = os.environ.get("TP2_WIRE")
    wire = yours or (INT8 if n == 2 and wires[INT8] >= COMPRESS_GAIN * wires[EXACT] else EXACT)
    said = ", ".join(f"{w} {x:.2f}x" for w, x in wires.items())
    lines = [f"wires (TP2_WIRE; a model, no overlap): {said}; {'yours' if yours else 'picked'}: {wire} (exact: in "
             f"TP2_REDUCE_DTYPE={dtype})"]  # fmt: skip
    shown = set()
    for label, shares in (("even", even(n)), ("--split auto", auto), ("--split", chosen)):
        if shares is None or shares in shown:
            continue
        shown.add(shares)
        speedup, comm = predict(shares, wire)
        lines.append(
            f"{label}: {verdict(speedup, shares)} (wire {wire}: collectives {comm * 1e3:.2f} ms per block of {shape.tokens} tokens)"
        )
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("0", "1") or not all(g.isdigit() for g in argv[1:]):
        print(f"balance: usage: balance.py CPU(0|1) GPU... (one GPU index per rank), got {' '.join(argv) or 'nothing'}", file=sys.stderr)
        return 2
    cpu, gpus = argv[0] == "1", argv[1:]
    if not cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(gpus))  # before torch starts CUDA
    try:
        names, samples, free = measure(cpu, gpus)
        shares, why_even = auto_split(names, samples, free)
        seconds = [statistics.median(s) for s in samples]
    except Exception as e:  # the launcher shows this line and asks for --split by hand
        print(f"balance: could not measure {'the CPU' if cpu else 'GPUs ' + ','.join(gpus)}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    shape = CPU_BLOCK if cpu else H3_BLOCK
    print(f"--split auto: one block at {shape.tokens} tokens, hidden {shape.hidden}, {'int8 ConvRot bf16' if shape.int8 else 'float32'}, "
          f"median of {MEASUREMENTS}", file=sys.stderr)  # fmt: skip
    print(describe_auto(names, seconds, free, shares), file=sys.stderr)
    if why_even:
        print(f"--split auto keeps the even split: {why_even}", file=sys.stderr)
    try:  # what the link makes of it (docs/PERFORMANCE.md's model of a pair); the shares stand without it
        link = measure_link_between(cpu, gpus)
        print("\n".join([f"link: {link.text()}", *speed_lines(seconds, shares, link, shares, cpu)]), file=sys.stderr)
    except Exception as e:
        print(f"balance: the link between the ranks was not measured ({type(e).__name__}: {e}); no speed-up predicted", file=sys.stderr)
    print(":".join(map(str, shares)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
