"""Benchmark-only ComfyUI custom node: a per-kernel GPU profile of one H3 diffusion-model call (no nodes of its own),
the one-GPU mode's process group, and the emulated link.

The benchmarks link it into custom_nodes. TP2_BENCH_GLOO_ON_CUDA=1 (ranks sharing one GPU, which NCCL refuses): the
pack's tp2.collectives.group_backend answers gloo. TP2_BENCH_PROFILE_DIR=DIR: the TP2_BENCH_PROFILE_CALL-th call
(default 3) of MiniMaxH3Model.forward runs under torch.profiler and DIR/<tag>.json and .txt get every GPU kernel's time
and count, the time per category, and the NCCL time no compute kernel overlapped. TP2_BENCH_HOST_LOG=1: at each node's
start (ComfyUI's `executing` event) a `tp2-bench host` log line: this process's /proc status (anonymous, file, shmem,
locked) and ComfyUI's page-locked host copies, in all and per loaded model. TP2_BENCH_LINK=GBPS[:LATENCY_US]: rank 0's
tensor collectives over an emulated link, the other ranks hollow (_emulated_link). Nothing else here changes what is
computed. Always: every SaveLatent's tensor digest as this rank computed it, logged (_latent_digests).
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import logging
import os
import re
import sys
import tempfile
import time

NODE_CLASS_MAPPINGS: dict = {}
PACK = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
log = logging.getLogger("tp2_bench_profiler")

CATEGORIES = (  # first match wins; kernel names of comfy-kitchen 0.2.31, PyTorch 2.11 and NCCL
    ("nccl", r"nccl"),
    ("int8_gemm", r"cutlass|gemm|Gemm|igemm|s8|int8_linear|dequant"),
    ("attention", r"attn|attention|flash|fmha|sage"),
    ("quantize", r"quantiz|convrot|hadamard"),
    ("norm_rope", r"rms|norm|rope"),
    ("copy_cast", r"copy|Copy|cat|pad|gather|scatter|index|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|Reduce|silu|mul|add"),
)


def _category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name):
            return cat
    return "other"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def summarize(trace_path: str, wall_ms: float) -> dict:
    """Kernel totals, categories and exposed NCCL time from a chrome trace written by torch.profiler."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    per_kernel, per_cat = collections.defaultdict(lambda: [0.0, 0]), collections.defaultdict(float)
    for e in kernels:
        per_kernel[e["name"]][0] += e["dur"] / 1e3
        per_kernel[e["name"]][1] += 1
        per_cat[_category(e["name"])] += e["dur"] / 1e3
    nccl = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if _category(e["name"]) == "nccl"])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if _category(e["name"]) != "nccl"])
    busy = _union(nccl + compute)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
    gaps = collections.defaultdict(lambda: [0.0, 0])  # idle GPU (no kernel on any stream) by the kernels around it
    end, prev = None, None
    for e in sorted(kernels, key=lambda e: e["ts"]):
        if end is not None and e["ts"] > end:
            gaps[prev["name"][:70], e["name"][:70]][0] += (e["ts"] - end) / 1e3
            gaps[prev["name"][:70], e["name"][:70]][1] += 1
        if end is None or e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    return {
        "wall_ms": round(wall_ms, 2),
        "gpu_busy_ms": round(_length(busy) / 1e3, 2),
        "compute_busy_ms": round(_length(compute) / 1e3, 2),
        "nccl_ms": round(_length(nccl) / 1e3, 2),
        "nccl_exposed_ms": round((_length(busy) - _length(compute)) / 1e3, 2),  # NCCL time with no compute kernel beside it
        "categories_ms": {c: round(v, 2) for c, v in sorted(per_cat.items(), key=lambda kv: -kv[1])},
        "kernels": [{"name": n[:160], "ms": round(t, 3), "count": c, "category": _category(n)} for n, (t, c) in top],
        "idle_gaps": [
            {"ms": round(t, 3), "count": c, "after": a, "before": b}
            for (a, b), (t, c) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:15]
        ],
    }


def _text(tag: str, s: dict) -> str:
    lines = [
        f"{tag}: one H3 diffusion-model call, wall {s['wall_ms']} ms; GPU busy {s['gpu_busy_ms']} ms, compute kernels "
        f"{s['compute_busy_ms']} ms, NCCL {s['nccl_ms']} ms of which exposed (no compute kernel running) {s['nccl_exposed_ms']} ms",
        "categories (kernel time, ms): " + ", ".join(f"{c} {v}" for c, v in s["categories_ms"].items()),
        "",
        f"{'ms':>9} {'count':>6}  category     kernel",
    ]
    for k in s["kernels"][:60]:
        lines.append(f"{k['ms']:9.3f} {k['count']:6d}  {k['category']:<12} {k['name'][:110]}")
    lines += ["", "GPU idle (no kernel on any stream), by the kernels before and after:"]
    for g in s["idle_gaps"]:
        lines.append(f"{g['ms']:9.3f} {g['count']:6d}  after {g['after']}  before {g['before']}")
    return "\n".join(lines) + "\n"


def _install(out_dir: str, call_no: int) -> None:
    import comfy.ldm.minimax.model as h3
    import torch

    # forward, not _forward: the pack checks _forward's source before it puts in its sequence-parallel blocks, and a
    # replaced _forward would turn them off (the profile would then be of plain TP, not of what the pack runs)
    original = h3.MiniMaxH3Model.forward
    calls = {"n": 0}
    tag = f"rank{os.environ['TP2_RANK']}" if os.environ.get("TP2_RANK") else "tp1"

    def profiled_forward(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] != call_no:
            return original(self, *args, **kwargs)
        cuda = torch.cuda.is_available()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        sync()
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            out = original(self, *args, **kwargs)
            sync()
            wall_ms = (time.perf_counter() - t0) * 1e3
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(trace)
            summary = summarize(trace, wall_ms)
        with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(out_dir, f"{tag}.txt"), "w") as f:
            f.write(_text(tag, summary))
        log.info("profile of H3 call %d written to %s (%s)", call_no, out_dir, tag)
        return out

    h3.MiniMaxH3Model.forward = profiled_forward


def _pack_module(name: str, why: str):
    """The pack's module `name` (e.g. tp2.collectives) as ComfyUI loaded it: call after every custom node is loaded."""
    want = os.path.join(PACK, *name.split(".")) + ".py"
    for loaded, mod in list(sys.modules.items()):
        if loaded.endswith("." + name) and os.path.realpath(getattr(mod, "__file__", "") or "") == want:
            return mod
    raise RuntimeError(f"{why}: the pack at {PACK} is not loaded; link it into custom_nodes")


def _on_startup(fn) -> None:
    """`fn()` once ComfyUI has loaded every custom node (the order is the folder's)."""
    from server import PromptServer

    async def run(app) -> None:
        fn()

    PromptServer.instance.app.on_startup.append(run)


def _gloo_on_cuda() -> None:
    """The pack's groups over gloo."""
    _pack_module("tp2.collectives", "TP2_BENCH_GLOO_ON_CUDA").group_backend = lambda device: "gloo"
    log.info("the TP group forms over gloo (TP2_BENCH_GLOO_ON_CUDA)")


def _emulated_link(spec: str) -> None:
    """TP2_BENCH_LINK=GBPS[:LATENCY_US], every rank on one GPU (bench_comfy.py's variant linkB-L): rank 0 runs for
    real, its tensor collectives over that link (scripts/bench/link_emulator.py); the other ranks are hollow peers:
    they load, meet rank 0 and take its inputs as TP ranks do, but their DiT blocks hand x straight on and their tensor
    collectives take no time, so the GPU is rank 0's. Outputs: rank 0's (the pack makes every rank's files its own)."""
    import comfy.ldm.minimax.model as h3

    found = importlib.util.spec_from_file_location("tp2_bench_link_emulator", os.path.join(PACK, "scripts", "bench", "link_emulator.py"))
    emulator = sys.modules[found.name] = importlib.util.module_from_spec(found)  # its dataclasses look their module up
    found.loader.exec_module(emulator)
    rank = int(os.environ.get("TP2_RANK", "0"))
    link = emulator.Link.parse(spec) if rank == 0 else emulator.FREE
    collectives = _pack_module("tp2.collectives", "TP2_BENCH_LINK")
    emulator.emulate_group_formation(_pack_module("tp2.session", "TP2_BENCH_LINK"), collectives, link)
    if rank == 0:
        _log_link_per_call(h3, collectives)
        log.info("TP2_BENCH_LINK: rank 0, its collectives over an emulated link of %s", link.text())
    else:
        h3.DiTBlock.__call__ = lambda block, x, *args, **kwargs: x
        log.info("TP2_BENCH_LINK: rank %d, a hollow peer", rank)


def _log_link_per_call(h3, collectives) -> None:
    """After each H3 model call, a log line: the collectives it issued and how long they held the link (as set)."""
    original = h3.MiniMaxH3Model.forward

    def forward(self, *args, **kwargs):
        before = list(getattr(collectives.dist, "issued", (0, 0, 0.0)))
        out = original(self, *args, **kwargs)
        n, nbytes, seconds = (b - a for a, b in zip(before, getattr(collectives.dist, "issued", before)))
        log.info("TP2_BENCH_LINK: this model call issued %d collectives, %.1f MB, %.1f ms on the link", n, nbytes / 1e6, seconds * 1e3)
        return out

    h3.MiniMaxH3Model.forward = forward


def _host_memory_log() -> None:
    """One `tp2-bench host node=ID {...}` line per `executing` event: the host memory as that node starts (the previous ends)."""
    import comfy.model_management as mm
    import torch
    from server import PromptServer

    server, gib = PromptServer.instance, lambda b: round(b / 2**30, 3)
    original = server.send_sync

    def snapshot() -> dict:
        with open("/proc/self/status") as f:
            st = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line) if v.strip().endswith("kB")}
        out = {k: gib(st.get(k, 0)) for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin")}
        out["pinned"] = gib(mm.TOTAL_PINNED_MEMORY)
        if torch.cuda.is_available():  # torch's own pinned blocks (gloo's staging of CUDA tensors, pin_memory()), cached
            out["torch_host_alloc"] = gib(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
        dynamic = [lm.model for lm in mm.current_loaded_models if lm.model is not None and lm.model.is_dynamic()]
        # per model: its registered pins, its host buffers
        out["models"] = {type(m.model).__name__: [gib(m.pinned_memory_size()), gib(m.loaded_ram_size())] for m in dynamic}
        return out

    def send_sync(event, data, sid=None):
        if event == "executing":
            try:
                log.info("tp2-bench host node=%s %s", (data or {}).get("node"), json.dumps(snapshot()))
            except Exception as e:  # noqa: BLE001 - a benchmark readout never fails the prompt
                log.info("tp2-bench host node=? error %s", e)
        return original(event, data, sid)

    server.send_sync = send_sync


def _latent_digests() -> None:
    """Each SaveLatent's tensor as this rank computed it, logged (`tp2-bench latent PREFIX SHA256`) before it is written:
    the pack makes the ranks' files the same bytes afterwards, so the files cannot say whether the ranks computed alike."""
    import torch

    import nodes

    save = nodes.SaveLatent.save

    def logged(self, samples, filename_prefix="ComfyUI", *args, **kwargs):
        t = samples["samples"].detach().contiguous().cpu()
        log.info("tp2-bench latent %s %s", filename_prefix, hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
        return save(self, samples, filename_prefix, *args, **kwargs)

    nodes.SaveLatent.save = logged


_latent_digests()
if os.environ.get("TP2_BENCH_HOST_LOG") == "1":
    _host_memory_log()
if os.environ.get("TP2_BENCH_GLOO_ON_CUDA") == "1":
    _on_startup(_gloo_on_cuda)
if os.environ.get("TP2_BENCH_LINK"):
    _on_startup(lambda: _emulated_link(os.environ["TP2_BENCH_LINK"]))
if os.environ.get("TP2_BENCH_PROFILE_DIR"):
    _install(os.environ["TP2_BENCH_PROFILE_DIR"], int(os.environ.get("TP2_BENCH_PROFILE_CALL", "3")))
