#!/usr/bin/env python3
"""A link of set bandwidth and latency between TP ranks, emulated for one rank that runs for real: the timing of TP2 on
a link we have no machine for (PCIe without peer-to-peer, a 4090 + 3090) from one GPU, and the gain of TP2_OVERLAP.

tp2.collectives reaches torch.distributed through its module global `dist`; `collectives_through` puts EmulatedDist
there. It answers the tensor collectives TP2 issues in a step (all_reduce, reduce_scatter_tensor,
all_gather_into_tensor, all_gather, all_to_all_single) itself, at the same points, with the same sizes, and hands everything else to
torch.distributed (group set-up, the CPU group's object broadcasts, broadcast_tree's tensors: a peer needs those).
Each collective holds one serial link for latency + bytes x bus factor / bandwidth (NCCL's: all-reduce 2(n-1)/n of its
size; reduce-scatter, all-gather and all-to-all (n-1)/n of the whole tensor), from when its input is ready and the link is free:
  CPU   a time model: the completion time is set at issue; the wait sleeps until then.
  CUDA  a side stream is the link: it waits for the input, spins torch.cuda._sleep for the link time (cycles
        calibrated once, on an idle GPU), then fills the outputs; the waiter's stream waits for it, as for NCCL's
        work, so compute issued in between overlaps. Real NCCL also takes SMs from that compute (its channels);
        the emulated link takes one thread: what it shows TP2_OVERLAP hide is an upper bound.
Values: an all-reduce leaves this rank's partial sum as it is (x2 would add a kernel NCCL does not run here; the
int8 GEMM, attention and norm kernels take the same time whatever finite values they get, and a partial sum is of
the sum's magnitude); a reduce-scatter gives this rank's rows of its input, an all-gather this rank's rows in every
rank's place. Every collective is recorded as a Collective (op, shape, dtype, bytes, call site, what was issued
before its wait); with no link, EmulatedDist records a real group's collectives and runs them for real.

The ComfyUI benchmark uses it through scripts/bench/profiler_node (TP2_BENCH_LINK: bench_comfy.py's variant linkB-L;
2:link216-10+overlap1 is NCCL's reduce-scatter on 2x H200, docs/bench/2026-11-30_profile_tp2_bf16_sp_fnorm_rank0.txt,
with TP2_OVERLAP off as those figures were taken). This file as a script times one rank's
H3 block (scripts/lib/balance.py's, the row-parallel layers through tp2.layers; `--fast`: sequence parallelism's) per
wire (TP2_WIRE; `--wire fp32,bf16,int8`) and TP2_OVERLAP, over each link of `--link`, `--tp1` beside the whole block on one GPU:
  mkdir -p /tmp/ck && tar -C /tmp/ck -xJf .device/comfy_kitchen.tar.xz
  PYTHONPATH=$PWD:/tmp/ck python3 scripts/bench/link_emulator.py --link 10:15,25:10 --tokens 15100 --wire bf16,int8 --tp1  [--fast] [--cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import unittest.mock

import torch
import torch.distributed as dist

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    **{op: lambda n: (n - 1) / n for op in ("reduce_scatter", "all_gather", "all_to_all")},
}
CALIBRATION_CYCLES = 20_000_000  # torch.cuda._sleep's spin timed once: ~10 ms on an H100 or H200
LIB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lib")  # balance.py: the block


@dataclasses.dataclass(frozen=True)
class Link:
    gbps: float  # bus bandwidth, GB/s (nccl-tests' busbw)
    latency_s: float = 0.0

    @staticmethod
    def parse(text: str) -> Link:
        """'GBPS[:LATENCY_US]', e.g. '216:10'."""
        gbps, _, latency_us = text.partition(":")
        return Link(float(gbps), float(latency_us or 0) / 1e6)

    def seconds(self, op: str, nbytes: int, tp_size: int) -> float:
        """How long `op` of `nbytes` (the whole tensor) holds the link."""
        return self.latency_s + nbytes * BUS_FACTOR[op](tp_size) / (self.gbps * 1e9)

    def text(self) -> str:
        return f"{self.gbps:g} GB/s, {self.latency_s * 1e6:g} us"


FREE = Link(math.inf)  # a link that takes no time: the compute alone


@dataclasses.dataclass
class Collective:
    """One tensor collective as issued: `shape` and `dtype` of this rank's input, `nbytes` of the whole tensor (a
    reduce-scatter's input, an all-gather's output), `site` the innermost caller outside tp2/collectives.py and tp2/wire.py, and
    `issued_before_wait` the collectives issued after it and before its wait (0: waited before the next started)."""

    op: str
    shape: tuple
    dtype: str
    nbytes: int
    site: str
    index: int
    issued_before_wait: int | None = None
    link_s: float = 0.0
    work: object = dataclasses.field(default=None, repr=False)

    def key(self) -> tuple:
        return self.op, self.shape, self.dtype, self.nbytes, self.site, self.issued_before_wait


class TimedWork:
    """A collective on the CPU's link: done at `done_at` (time.perf_counter)."""

    def __init__(self, started_at: float, done_at: float):
        self.started_at, self.done_at = started_at, done_at

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.done_at

    def wait(self, timeout=None) -> bool:
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return True

    def delivered_s(self) -> float:
        return self.done_at - self.started_at


class HostLink:
    """The CPU's link: a time model, one collective after another."""

    def __init__(self):
        self.free_at = 0.0

    def start(self, seconds: float, fill, tensors) -> TimedWork:
        fill()
        started = max(time.perf_counter(), self.free_at)
        self.free_at = started + seconds
        return TimedWork(started, self.free_at)


class StreamWork:
    """A collective on a CUDA link stream: done when its end event is; the waiter's stream waits for that event."""

    def __init__(self, device: torch.device, begin: torch.cuda.Event, end: torch.cuda.Event):
        self.device, self.begin, self.end = device, begin, end

    def is_completed(self) -> bool:
        return self.end.query()

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream(self.device).wait_event(self.end)
        return True

    def delivered_s(self) -> float:
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1e3


def sleep_cycles_per_second(device: torch.device) -> float:
    """torch.cuda._sleep's clock on `device`, timed with events (median of 3)."""
    rates = []
    with torch.cuda.device(device):
        torch.cuda._sleep(CALIBRATION_CYCLES)  # the clocks up first
        for _ in range(3):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            torch.cuda._sleep(CALIBRATION_CYCLES)
            end.record()
            end.synchronize()
            rates.append(CALIBRATION_CYCLES / (begin.elapsed_time(end) / 1e3))
    return sorted(rates)[1]


class StreamLink:
    """A CUDA device's link: a side stream that each collective holds, in issue order, for its seconds."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.cycles_per_s = sleep_cycles_per_second(device)

    def start(self, seconds: float, fill, tensors) -> StreamWork:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the input is ready
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            begin.record()
            if seconds > 0:
                torch.cuda._sleep(int(seconds * self.cycles_per_s))
            fill()
            end.record()
        for t in tensors:  # the allocator must not hand their memory on while the link stream still uses it
            t.record_stream(self.stream)
        return StreamWork(self.device, begin, end)


class RecordedWork:
    """A collective's work (emulated or real) that notes in its Collective when it is waited for."""

    def __init__(self, work, collective: Collective, records: list):
        self._work, self._collective, self._records = work, collective, records

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self, timeout=None):
        if self._collective.issued_before_wait is None:
            self._collective.issued_before_wait = len(self._records) - 1 - self._collective.index
        return self._work.wait() if timeout is None else self._work.wait(timeout)


def call_site(skip: tuple[str, ...]) -> str:
    """'file.py:line function' of the innermost caller outside the files `skip` (a comprehension or lambda: its function)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename in skip or frame.f_code.co_name in ("<listcomp>", "<genexpr>", "<lambda>")):
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}" if frame else "?"


class EmulatedDist:
    """torch.distributed for tp2.collectives, seen from rank `tp_rank` of `tp_size`: the tensor collectives over
    `link` (None: the real group's, only recorded), recorded in `records` (None: not kept); the rest is torch's."""

    def __init__(self, tp_rank: int, tp_size: int, link: Link | None, records: list | None, collectives_file: str):
        self.tp_rank, self.tp_size, self.link, self.records = tp_rank, tp_size, link, records
        self._skip = (collectives_file, os.path.join(os.path.dirname(collectives_file), "wire.py"), __file__)
        self._links: dict[torch.device, HostLink | StreamLink] = {}
        self.issued = [0, 0, 0.0]  # collectives, bytes, seconds on the link (as set), since the start

    def __getattr__(self, name: str):
        return getattr(dist, name)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        real = lambda: dist.all_reduce(tensor, op, group=group, async_op=True)  # noqa: E731
        return self._issue("all_reduce", tensor, tensor.nbytes, lambda: None, [tensor], real, async_op)

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        mine = input.narrow(0, self.tp_rank * output.shape[0], output.shape[0])
        real = lambda: dist.reduce_scatter_tensor(output, input, op, group=group, async_op=True)  # noqa: E731
        return self._issue("reduce_scatter", input, input.nbytes, lambda: output.copy_(mine), [output, input], real, async_op)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        fill = lambda: output_tensor.view(self.tp_size, -1).copy_(input_tensor.reshape(1, -1))  # noqa: E731
        real = lambda: dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=True)  # noqa: E731
        return self._issue("all_gather", input_tensor, output_tensor.nbytes, fill, [output_tensor, input_tensor], real, async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        fill = lambda: [part.copy_(tensor) for part in tensor_list]  # noqa: E731
        real = lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=True)  # noqa: E731
        return self._issue("all_gather", tensor, tensor.nbytes * len(tensor_list), fill, [*tensor_list, tensor], real, async_op)

    def all_to_all_single(self, output, input, group=None, async_op=False):
        fill = lambda: output.copy_(input)  # noqa: E731 - every peer's rows as this rank's own
        real = lambda: dist.all_to_all_single(output, input, group=group, async_op=True)  # noqa: E731
        return self._issue("all_to_all", input, input.nbytes, fill, [output, input], real, async_op)

    def _issue(self, op: str, mine: torch.Tensor, nbytes: int, fill, tensors, real, async_op: bool):
        """Start `op` (`mine`: this rank's input; `nbytes`: the whole tensor's) over the link, or `real()` without one."""
        if self.link is None:
            work, seconds = real(), 0.0
        else:
            seconds = self.link.seconds(op, nbytes, self.tp_size)
            work = self._link(mine.device).start(seconds, fill, tensors)
        self.issued = [self.issued[0] + 1, self.issued[1] + nbytes, self.issued[2] + seconds]
        if self.records is not None:
            record = Collective(op, tuple(mine.shape), str(mine.dtype), nbytes, call_site(self._skip), len(self.records), link_s=seconds)
            record.work = work if self.link is not None else None  # a real work holds its tensors
            self.records.append(record)
            work = RecordedWork(work, record, self.records)
        return work if async_op else work.wait()

    def _link(self, device: torch.device) -> HostLink | StreamLink:
        if device not in self._links:
            self._links[device] = StreamLink(device) if device.type == "cuda" else HostLink()
        return self._links[device]


def collectives_through(collectives, shim: EmulatedDist):
    """tp2.collectives (the module `collectives`) calling `shim` for torch.distributed while the block runs."""
    return unittest.mock.patch.object(collectives, "dist", shim)


def present(tp, backend: str):
    """`tp` (a tp2.collectives.TPGroup) as a group of `backend`: tp2.collectives takes that backend's path (NCCL's:
    reduce_scatter_tensor, all_gather_into_tensor, TP2_OVERLAP's default of 4 chunks) whatever carries it."""
    tp.__dict__["backend"] = backend  # TPGroup.backend and .overlap are cached properties
    tp.__dict__.pop("overlap", None)
    return tp


def lone_rank(collectives, tp_rank: int, tp_size: int, device: torch.device, backend: str = "nccl"):
    """Rank `tp_rank` of a `tp_size` TP group with no peer and no process group: for tensor collectives only,
    under collectives_through with a link."""
    return present(collectives.TPGroup(tp_rank, tp_size, device, None, None, 60.0), backend)


def emulate_group_formation(session, collectives, link: Link) -> None:
    """Every group tp2.session forms from now on (`session`, `collectives`: the pack's modules as loaded) is a real
    group whose tensor collectives run over `link` on NCCL's path; its CPU group and broadcasts stay real."""
    form = session.init_tp_group

    def init_tp_group(env, *args, **kwargs):
        tp = form(env, *args, **kwargs)
        collectives.dist = EmulatedDist(tp.tp_rank, tp.tp_size, link, None, collectives.__file__)
        return present(tp, "nccl")

    session.init_tp_group = init_tp_group


def rank_block(balance, shape, x, weights, gemm, tp, reduce_dtype: torch.dtype) -> torch.Tensor:
    """One rank's H3 block as plain TP runs it (nodes/sequence_parallel.py's _pipelined_block, without its elementwise
    residual, norm and modulation): qkv and attention over its heads (scripts/lib/balance.py), out_proj row-parallel in
    TP2_OVERLAP chunks, and as each chunk's sum arrives, that chunk's fc1 and fc2, its sum started behind the next chunk."""
    from tp2.layers import STARTED, joined, local_linear, row_parallel
    from tp2.wire import start_sum

    mlp = []
    for a, b, attn in row_parallel(balance.attend(shape, x, weights, gemm), weights["out"], None, tp, gemm, reduce_dtype, reduce=STARTED):
        h = attn.result()
        up = local_linear(h, weights["fc1"], None, h.dtype, gemm)
        y = local_linear(up, weights["fc2"], None, reduce_dtype, gemm, "swiglu")
        mlp.append((a, b, start_sum(y, tp, tp.wire if shape.int8 else "exact", h.dtype, False)))
    return joined(mlp)


def rank_block_sp(balance, shape, x, weights, gemm, tp, reduce_dtype: torch.dtype) -> torch.Tensor:
    """One rank's H3 block as `--fast` runs it (nodes/sequence_parallel.py's _block_forward, without its elementwise
    norm, modulation and residual): this rank's rows gathered before qkv and before fc1 as the int8 gathers carry them
    (int8 rows, then fp32 row scales), out_proj reduce-scattered to this rank's rows, fc2 reduce-scattered in
    TP2_OVERLAP's sub-blocks of every rank's rows (tp2.layers.reduced). The GEMMs take `x`, the whole sequence the
    gathered rows stand for (the link carries the int8 bytes; the compute is the same)."""
    from tp2.collectives import start_all_gather_rows
    from tp2.layers import local_linear, reduced, row_parallel
    from tp2.sequence_layout import RowLayout

    layout = RowLayout.plan(shape.tokens, tp.tp_size, tp.tp_rank)

    def gathered(width: int) -> None:
        rows = start_all_gather_rows(torch.zeros((layout.m, width), dtype=torch.int8, device=x.device), tp)
        start_all_gather_rows(torch.ones((layout.m, 1), device=x.device), tp).result()
        rows.result()

    gathered(shape.hidden)
    row_parallel(balance.attend(shape, x, weights, gemm), weights["out"], None, tp, gemm, reduce_dtype, reduce=layout)
    gathered(shape.hidden)

    def mlp(a: int, b: int) -> torch.Tensor:
        up = local_linear(x[a:b], weights["fc1"], None, x.dtype, gemm)
        return local_linear(up, weights["fc2"], None, reduce_dtype, gemm, "swiglu")

    return reduced(mlp, layout.full, tp, layout, shape.int8, x.dtype)


def time_block(balance, shape, device: torch.device, link: Link, overlap: int, reduce_dtype: torch.dtype, repeats: int,
               wire: str = "exact", tp_size: int = 2, block=None) -> dict:  # fmt: skip
    """rank_block's median seconds over `link` with TP2_OVERLAP=`overlap` and TP2_WIRE=`wire`, the seconds its
    collectives held the link as set and as delivered, and how many there were (`balance`: scripts/lib/balance.py)."""
    import statistics

    from kernels import select_int8_gemm
    from tp2 import collectives, settings

    gemm = select_int8_gemm(settings.value("TP2_INT8_KERNEL"))
    weights = balance.block_weights(shape, device, torch.bfloat16)
    x = torch.randn(shape.tokens, shape.hidden, device=device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    records: list[Collective] = []
    with collectives_through(collectives, EmulatedDist(0, tp_size, link, records, collectives.__file__)):
        tp = lone_rank(collectives, 0, tp_size, device)
        tp.overlap, tp.wire = overlap, wire
        seconds = []
        for _ in range(balance.WARMUP + repeats):
            records.clear()
            sync()
            start = time.perf_counter()
            (block or rank_block)(balance, shape, x, weights, gemm, tp, reduce_dtype)
            sync()
            seconds.append(time.perf_counter() - start)
    block_s = statistics.median(seconds[balance.WARMUP :])
    link_s, delivered_s = sum(c.link_s for c in records), sum(c.work.delivered_s() for c in records if c.work)  # the last block's
    return {"block_s": block_s, "link_s": link_s, "delivered_s": delivered_s, "collectives": len(records)}


def main() -> None:
    ap = argparse.ArgumentParser(description="One TP2 rank's H3 block over an emulated link, on and off TP2_OVERLAP (ms per block).")
    ap.add_argument("--link", default="10:15", help="GBPS[:LATENCY_US],... (default: PCIe without peer-to-peer, NCCL through host memory)")
    ap.add_argument("--tokens", type=int, default=15100, help="15100: 832x480x124")
    ap.add_argument("--overlap", default="1,4", help="TP2_OVERLAP chunks to time")
    ap.add_argument(
        "--reduce-dtype", choices=("fp32", "bf16"), default="fp32", help="TP2_REDUCE_DTYPE (the compressed wires' partial sums)"
    )
    ap.add_argument("--wire", default="exact", help="wires to time: exact (in --reduce-dtype), fp32, bf16 (exact in that dtype), int8")
    ap.add_argument("--fast", action="store_true", help="--fast's block (sequence parallelism: gathers and reduce-scatters)")
    ap.add_argument("--tp1", action="store_true", help="also the whole block on one GPU (no collectives): vs_tp1 = its ms / block_ms")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--cpu", action="store_true", help="a small int8 block on the CPU (eager GEMM): a check of the script")
    a = ap.parse_args()
    sys.path.insert(0, LIB)
    import balance

    from kernels import wire_codec
    from tp2 import wire as wires

    device = torch.device("cpu" if a.cpu else "cuda")
    whole = dict(heads=8, head_dim=64, hidden=512, ffn=1024, tokens=256) if a.cpu else dict(tokens=a.tokens)
    shape = dataclasses.replace(balance.H3_BLOCK, **whole)
    half = dataclasses.replace(shape, heads=shape.heads // 2, ffn=shape.ffn // 2)  # one rank's widths at an even split
    wires.use_fused(wire_codec.select)
    tp1_ms = time_block(balance, shape, device, FREE, 1, torch.float32, a.repeats, tp_size=1)["block_s"] * 1e3 if a.tp1 else None
    for wire, overlap in ((w, int(n)) for w in a.wire.split(",") for n in a.overlap.split(",")):
        dtype = wire if wire in ("fp32", "bf16") else a.reduce_dtype
        setting = "exact" if wire in ("fp32", "bf16") else wire
        reduce_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        block = rank_block_sp if a.fast else rank_block
        alone = time_block(balance, half, device, FREE, overlap, reduce_dtype, a.repeats, setting, block=block)
        for link in map(Link.parse, a.link.split(",")):
            over = time_block(balance, half, device, link, overlap, reduce_dtype, a.repeats, setting, block=block)
            row = dict(link=link.text(), fast=a.fast, overlap=overlap, tokens=half.tokens, reduce=dtype, wire=setting, collectives=over["collectives"],
                       block_ms=round(over["block_s"] * 1e3, 3), compute_ms=round(alone["block_s"] * 1e3, 3),
                       link_ms=round(over["link_s"] * 1e3, 3), delivered_ms=round(over["delivered_s"] * 1e3, 3),
                       exposed_ms=round((over["block_s"] - alone["block_s"]) * 1e3, 3))  # fmt: skip
            if tp1_ms is not None:
                row.update(tp1_ms=round(tp1_ms, 3), vs_tp1=round(tp1_ms / (over["block_s"] * 1e3), 3))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
