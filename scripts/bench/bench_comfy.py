#!/usr/bin/env python3
"""TP1 vs TP2 (vs TP4) on real ComfyUI servers, side by side in one invocation, on one GPU machine.

    python scripts/bench/bench_comfy.py --comfyui DIR --base DIR --front-end DIR --out DIR [--tp-sizes 1,2] [--steps 8]
        [--frames 124] [--resolutions 832x480,1344x768] [--memory-resolutions 1600x896,1920x1088] [--cap-gib G] [--one-gpu]

Per tp_size: start the servers (one per GPU; tp_size 1 = plain ComfyUI, pack inactive), run one latent-only T2V workflow
(conditioning from file, cfg 1, res_multistep/simple, seed 145) per resolution, and record: s/step (rank 0, from its first
step's progress event to the sampler node's end, its latent then on the host, per remaining step; beside it
s_per_step_progress, the median progress-event spacing, which understates a step the CPU runs ahead of; with --profile the span
includes writing the trace in step 3); each rank's checkpoint load (UNETLoader's span) and peak GPU memory (nvidia-smi every
0.5 s, also per process); whether all ranks computed the same latents (their tensors' digests, logged before the pack makes
the files alike) and how many outputs the pack replaced with rank 0's; the pack's capacity-check (not enforced here) and
sampler-peak log lines. Prints a table; writes bench.json. --cap-gib G: every process a G GiB card (CUDA MPS's per-process
limit, process_memory.confine_gpus; without MPS the script stops at once): a real limit for the allocator and dynamic VRAM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid

import aiohttp
import torch
from process_memory import ProcessSampler, confine_gpus, hold_host, need_mps, stop_all

BENCH_NODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiler_node")


def link_nodes(base: str, links: dict[str, str]) -> None:
    """Each {name: folder} into BASE/custom_nodes (bench.sh links the same): e.g. the profiler node, the one-GPU mode's group."""
    os.makedirs(os.path.join(base, "custom_nodes"), exist_ok=True)
    for name, target in links.items():
        if not os.path.lexists(link := os.path.join(base, "custom_nodes", name)):
            os.symlink(target, link)


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def serving(session, args, config: str, run: str, names: list[str], log: str, pack: bool, gpu0: bool, env: dict,
                  flags: list[str], ready_s: float, cap_gib: float | None = None, host_gib: float | None = None):  # fmt: skip
    """A ComfyUI server per name, the highest rank first, ready; all stopped afterwards: yields (the servers, the GPU cap
    in words or None). Rank r (names[r]) in folder RUN/NAME, logging to RUN/`log` (e.g. "{}.log"), on GPU r (gpu0: all
    on GPU 0), in this environment but the pack's settings (TP2_CACHE_DIR kept) plus `env`, with ComfyUI's `flags`;
    `pack`: each a rank of one TP group; `cap_gib`: each confined to that much GPU memory (CUDA MPS); `host_gib`: that
    much of the host held by another process while they run."""
    held, how, servers, master = [], None, [], free_port()
    try:
        if cap_gib:
            held, limit_env, how = confine_gpus(cap_gib)
            env = {**env, **limit_env}
            print(f"{config}: {how}", flush=True)
        if host_gib:
            held.append(hold_host(host_gib))
        for r in reversed(range(len(names))):
            d = os.path.join(run, names[r])
            for sub in ("output", "temp", "user"):
                os.makedirs(os.path.join(d, sub), exist_ok=True)
            e = {k: v for k, v in os.environ.items() if not k.startswith(("TP2_", "MASTER_")) or k == "TP2_CACHE_DIR"}
            e["CUDA_VISIBLE_DEVICES"] = "0" if gpu0 else str(r)
            if pack:
                e.update(TP2_RANK=str(r), TP2_WORLD_SIZE=str(len(names)), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
                         TP2_PROMPT_TIMEOUT_S="900", TP2_TIMEOUT_S="900")  # fmt: skip
            port, path = free_port(), os.path.join(run, log.format(names[r]))
            cmd = [sys.executable, "main.py", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", args.base,
                   "--output-directory", f"{d}/output", "--temp-directory", f"{d}/temp", "--user-directory", f"{d}/user",
                   "--database-url", f"sqlite:///{d}/db.sqlite", "--disable-auto-launch", "--disable-api-nodes",
                   "--front-end-root", args.front_end, *flags]  # fmt: skip
            p = subprocess.Popen(cmd, cwd=args.comfyui, env={**e, **env}, stdout=open(path, "ab"), stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
            servers.insert(0, {"name": names[r], "proc": p, "port": port, "dir": d, "log": path})
        deadline = time.monotonic() + ready_s
        for s in servers:
            await poll(session, s, "/system_stats", lambda _: True, 0.5, deadline)
        yield servers, how
    finally:
        for s in servers:
            if s["proc"].poll() is None:
                os.killpg(s["proc"].pid, signal.SIGTERM)
        for s in servers:
            try:
                s["proc"].wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(s["proc"].pid, signal.SIGKILL)
        stop_all(held)


async def poll(session, s: dict, path: str, done, every: float, deadline: float = float("inf")):
    """GET `path` of server `s` every `every` s until it answers 200 with JSON that done() accepts: that JSON. Its log's
    tail in a RuntimeError when it exits first or time.monotonic() passes `deadline`."""
    while s["proc"].poll() is None and time.monotonic() <= deadline:
        try:
            async with session.get(f"http://127.0.0.1:{s['port']}{path}") as r:
                if r.status == 200 and done(got := await r.json()):
                    return got
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(every)
    why = "not ready" if s["proc"].poll() is None else "exited"
    raise RuntimeError(f"{s['name']} {why}:\n" + open(s["log"], errors="replace").read()[-4000:])


async def submit(session, servers: list[dict], wf: dict, linger: float = 0.0) -> tuple[list, list, list[int], float, float]:
    """`wf` to every server as one prompt, each one's websocket events (time, type, data) kept until all have run it and
    `linger` s more: (their histories, their events, their logs' sizes before, when it was sent, when all had run it)."""
    pid, cids = str(uuid.uuid4()), [uuid.uuid4().hex for _ in servers]
    events: list[list] = [[] for _ in servers]
    log_at = [os.path.getsize(s["log"]) for s in servers]  # what the ranks log from here on

    async def watch(i, s):
        async with session.ws_connect(f"ws://127.0.0.1:{s['port']}/ws?clientId={cids[i]}") as sock:
            async for msg in sock:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    d = json.loads(msg.data)
                    events[i].append((time.time(), d["type"], d.get("data", {})))

    watchers = [asyncio.create_task(watch(i, s)) for i, s in enumerate(servers)]
    await asyncio.sleep(0.5)
    t0 = time.time()
    for s, cid in zip(servers, cids):
        async with session.post(f"http://127.0.0.1:{s['port']}/prompt", json={"prompt": wf, "prompt_id": pid, "client_id": cid}) as r:
            if r.status != 200:
                raise RuntimeError(f"{s['name']} refused the prompt: {await r.text()}")
    done = lambda got: got.get(pid, {}).get("status", {}).get("status_str") in ("success", "error")  # noqa: E731
    hists = [(await poll(session, s, f"/history/{pid}", done, 0.2))[pid] for s in servers]
    t1 = time.time()
    await asyncio.sleep(linger)
    for w in watchers:
        w.cancel()
    return hists, events, log_at, t0, t1


def step_times(events: list[tuple[float, str, dict]], node: str | None) -> list[float]:
    """When a server first reported each progress value of `node`, in order."""
    first_seen: dict[int, float] = {}
    for t, kind, d in events:
        if kind == "progress" and d.get("node") == node:
            first_seen.setdefault(d["value"], t)
    return [first_seen[v] for v in sorted(first_seen)]


def log_since(log: str, start: int) -> str:
    with open(log, errors="replace") as f:
        f.seek(start)
        return f.read()


def pack_lines(said: str) -> list[str]:
    """The pack's capacity prediction and sampling peak lines in a server's log text."""
    keys = (" capacity: ", " sampling peak: ", " sequence parallelism off ")
    return [line.strip()[-400:] for line in said.splitlines() if any(k in line for k in keys)]


# variant parts (--tp-sizes), joined with +: the environment or the ComfyUI flags each one sets
ENV_PARTS = {
    "bf16": {"TP2_REDUCE_DTYPE": "bf16"},  # the row-parallel reduce in bf16
    "sp": {"TP2_SEQUENCE_PARALLEL": "1"},
    "bf16ag": {"TP2_SEQUENCE_PARALLEL": "1", "TP2_SP_INT8_GATHER": "0"},  # SP, int8 linears' inputs gathered in bf16
    "fnorm": {"TP2_SEQUENCE_PARALLEL": "1", "TP2_SP_FUSED_NORM": "1"},  # SP with the fused norm/modulation kernels
    "int8": {"TP2_WIRE": "int8"},  # the row-parallel reduce through the compressed wires (tp2/wire.py)
    "exact": {"TP2_WIRE": "exact"},
}
FLAG_PARTS = {
    "lean": ("--disable-cuda-malloc",),  # the launcher's --lean-memory: torch's native allocator
    "fp32": ("--force-fp32",),  # fp32 compute, what a card below compute capability 8.0 runs
    "hv": ("--highvram", "--disable-async-offload"),  # every model resident, whatever --comfy-args says
}
# chunk16384; split3-1 is --split 3:1; overlap1 is TP2_OVERLAP=1 (off); link216-10: rank 0 runs for real on GPU 0, its
# collectives over an emulated 216 GB/s, 10 us link, the other ranks hollow beside it (scripts/bench/link_emulator.py)
NUMBERED_PARTS = {"chunk": "TP2_SP_CHUNK_ROWS", "split": "TP2_SPLIT", "overlap": "TP2_OVERLAP", "link": "TP2_BENCH_LINK"}
PARTS = (*ENV_PARTS, *FLAG_PARTS, "chunkN", "splitA-B", "overlapN", "linkB-L", "sdpa", "half", "pack", "easycache")


def one_gpu(args, variant: str) -> bool:
    """Every rank on GPU 0 over gloo: --one-gpu, or an emulated link (variant linkB-L)."""
    return args.one_gpu or any(part.startswith("link") for part in variant.split("+"))


def variant_settings(args, tp_size: int, variant: str) -> tuple[dict[str, str], list[str]]:
    """The environment and the ComfyUI flags of a configuration's servers."""
    options, env, flags = set(variant.split("+")) - {""}, {}, args.comfy_args.split()
    if tp_size > 1 or "pack" in options:
        env["TP2_ATTN_BACKEND"] = args.attn
    if one_gpu(args, variant) and tp_size > 1:
        env["TP2_BENCH_GLOO_ON_CUDA"] = "1"  # read by profiler_node: NCCL refuses two ranks on one GPU
    for o in sorted(options):
        name = o.rstrip("0123456789-")
        if o in ENV_PARTS:
            env.update(ENV_PARTS[o])
        elif o in FLAG_PARTS:
            flags += [a for a in FLAG_PARTS[o] if a not in flags]
        elif name in NUMBERED_PARTS and o != name:
            env[NUMBERED_PARTS[name]] = o[len(name) :].replace("-", ":")
        elif o not in ("sdpa", "half", "pack", "easycache"):
            raise SystemExit(f"unknown variant {o!r} in --tp-sizes (combine with +: {', '.join(PARTS)})")
    if "half" in options and tp_size != 1:
        raise SystemExit("variant 'half' (one GPU, a TP2 rank's half-width model, no communication) is for tp 1 only")
    if args.profile:
        env["TP2_BENCH_PROFILE_DIR"] = os.path.join(args.out, "profile", f"tp{tp_size}{variant.replace('+', '-')}")
    if "sdpa" in options:  # torch SDPA attention instead of comfy-kitchen int8 attention, TP1 and TP ranks alike
        flags = [a for a in flags if a != "--use-ck-attention"]
        if tp_size > 1:
            env["TP2_ATTN_BACKEND"] = "sdpa"
    return env, flags


def workflow(ckpt: str, cond: str, w: int, h: int, frames: int, steps: int, tag: str, easycache: bool = False) -> dict:
    """The sampler's graph; easycache: ComfyUI's EasyCache node (its defaults) between the model and the KSampler."""
    wf = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": ckpt, "weight_dtype": "default"}},
        "2": {"class_type": "LoadH3Conditioning", "inputs": {"file": cond}},
        "3": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["2", 0]}},
        "4": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": w, "height": h, "length": frames}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": 145, "steps": steps, "cfg": 1.0, "sampler_name": "res_multistep",
                                                    "scheduler": "simple", "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["5", 0]}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": f"latents/{tag}_video"}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 1], "filename_prefix": f"latents/{tag}_audio"}},
    }  # fmt: skip
    if easycache:
        inputs = {"model": ["1", 0], "reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}
        wf["9"] = {"class_type": "EasyCache", "inputs": inputs}
        wf["5"]["inputs"]["model"] = ["9", 0]
    return wf


async def run_one(session, servers, wf) -> dict:
    hists, events, log_at, t0, t1 = await submit(session, servers, wf)
    errors = [m for h in hists for k, m in h["status"].get("messages", []) if k == "execution_error"]
    if errors:
        return {"error": errors[0].get("exception_message", "")[:2000], "t0": t0, "t1": t1}
    steps = step_times(events[0], "5")  # rank 0's
    per_step = [b - a for a, b in zip(steps, steps[1:])]
    # The progress events are the CPU's view: where the sampler does not wait for the GPU each step (ComfyUI's dynamic
    # VRAM), the CPU runs ahead and their spacing understates a step. The sampler's node ends once its latent is on the
    # host, so from step 1's event to that end, per remaining step, counts the GPU's time too.
    ends = [t for t, kind, d in events[0] if kind == "executing" and steps and t > steps[-1]]
    s_per_step_span = (ends[0] - steps[0]) / (len(steps) - 1) if ends and len(steps) > 1 else None
    loads = []
    for ev in events:
        starts = [t for t, kind, d in ev if kind == "executing" and d.get("node") == "1"]
        after = [t for t, kind, d in ev if kind == "executing" and starts and t > starts[0] and d.get("node") != "1"]
        loads.append(round(after[0] - starts[0], 1) if starts and after else None)
    digests, video, replaced = [], None, 0
    for s, h, at in zip(servers, hists, log_at):
        for node in sorted(h["outputs"]):
            for item in h["outputs"][node].get("latents", []):
                video = video or (os.path.join(s["dir"], "output", item["subfolder"], item["filename"])
                                  if "_video" in item["filename"] else None)  # fmt: skip
        said = log_since(s["log"], at)
        # what each rank computed (the profiler node logs each saved latent's digest before the pack makes the files alike)
        digests.append(" ".join(sorted(line.split("tp2-bench latent ")[1] for line in said.splitlines() if "tp2-bench latent " in line)))
        replaced += said.count("other bytes than rank 0")  # nodes/same_outputs.py: a rank's output replaced by rank 0's
    return {"s_per_step": s_per_step_span, "s_per_step_progress": statistics.median(per_step) if per_step else None,
            "steps_timed": len(per_step), "load_s": loads, "identical": len(set(digests)) == 1 and digests[0] != "", "replaced": replaced,
            "digest": digests[0].split(" ")[-1][:12], "video_latent": video, "t0": t0, "t1": t1}  # fmt: skip


async def main_async(args) -> list[dict]:
    procs, rows, run_dir = ProcessSampler(cards=True), [], os.path.join(args.out, "run")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for config in args.tp_sizes:
                tp, _, variant = config.partition(":")
                tp = int(tp)
                pack = tp > 1 or "pack" in variant.split("+")  # variant 'pack' at tp 1: the pack active on one GPU
                env, flags = variant_settings(args, tp, variant)
                where = (run_dir, [f"tp{tp}{variant.replace('+', '-')}_rank{r}" for r in range(tp)], "{}.log", pack, one_gpu(args, variant))
                async with serving(session, args, config, *where, env, flags, 300, args.cap_gib) as (servers, _):
                    plan = [(r, args.steps, False) for r in args.resolutions] + (
                        [(r, args.memory_steps, True) for r in args.memory_resolutions] if tp > 1 else []
                    )
                    for res, steps, memory_only in plan:
                        marks = [os.path.getsize(s["log"]) for s in servers]
                        w, h, *f = (int(x) for x in res.split("x"))  # WxH, or WxHxFRAMES for a memory run at another length
                        frames = f[0] if f else args.frames
                        ckpt = args.half_ckpt if "half" in variant.split("+") else args.ckpt
                        wf = workflow(ckpt, args.cond, w, h, frames, steps, f"tp{tp}_{res}", "easycache" in variant.split("+"))
                        out = await run_one(session, servers, wf)
                        out.update(tp_size=tp, variant=variant or "-", resolution=res, steps=steps, memory_only=memory_only)
                        t0, t1 = out["t0"], out["t1"] + 1.0
                        out["peak_mib"] = [procs.peak(0 if one_gpu(args, variant) else g, "card_mib", t0, t1) for g in range(tp)]
                        out["process_peak_mib"] = [procs.peak(s["proc"].pid, "gpu_mib", t0, t1) for s in servers]
                        out["pack_log"] = [pack_lines(log_since(s["log"], at)) for s, at in zip(servers, marks)]
                        rows.append(out)
                        print(json.dumps({k: v for k, v in out.items() if k not in ("t0", "t1")}), flush=True)
    finally:
        procs.stop()
    return rows


def _baseline_key(r: dict) -> tuple[str, bool]:
    """TPn runs compare with the TP1 run at the same resolution, attention backend (ck int8 or SDPA), memory mode
    (variant hv: every model resident; otherwise what --comfy-args says) and compute dtype (variant fp32)."""
    options = str(r.get("variant", "")).split("+")
    return r["resolution"], "sdpa" in options, "hv" in options, "fp32" in options


def _is_baseline(r: dict) -> bool:
    """A one-GPU run of the full model by stock ComfyUI (not the half-width stand-in for one TP2 rank, not the pack
    at tp_size 1, whose ratio to this is its own speed-up)."""
    return r["tp_size"] == 1 and not {"half", "pack"} & set(str(r.get("variant", "")).split("+"))


def sqnr_vs_tp1(rows: list[dict]) -> None:
    """Each TPn run's final video latent against its TP1 baseline's (SQNR in dB), in place."""
    from safetensors.torch import load_file

    tp1 = {_baseline_key(r): r for r in rows if _is_baseline(r) and r.get("video_latent")}
    for r in rows:
        ref = tp1.get(_baseline_key(r))
        if r["tp_size"] > 1 and ref and r.get("video_latent"):
            a, b = (load_file(x["video_latent"])["latent_tensor"].double() for x in (ref, r))
            r["sqnr_db_vs_tp1"] = round(float(10 * torch.log10(a.pow(2).sum() / (a - b).pow(2).sum().clamp_min(1e-300))), 1)


def table(rows: list[dict]) -> str:
    tp1 = {_baseline_key(r): r for r in rows if _is_baseline(r) and "error" not in r}
    lines = [
        "| resolution | tp | variant | steps | s/step | TP1/TPn | peak GiB per GPU | peak GiB per process | load s per rank | latents identical (files replaced) | SQNR vs TP1 dB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f" | {r['tp_size']} | {r.get('variant', '')} | {r['steps']} | "  # after the resolution
        if "error" in r:
            lines.append(f"| {r['resolution']}{head}ERROR: {r['error'][:120]} | | | | | |")
            continue
        base = tp1.get(_baseline_key(r))
        ratio = f"{base['s_per_step'] / r['s_per_step']:.2f}x" if base and r["s_per_step"] and not _is_baseline(r) else "-"
        sps = f"{r['s_per_step']:.3f}" if r["s_per_step"] else "-"
        mem, own = (", ".join("-" if m is None else f"{m / 1024:.1f}" for m in r.get(k, [])) for k in ("peak_mib", "process_peak_mib"))
        lines.append(f"| {r['resolution']}{' (memory)' if r['memory_only'] else ''}{head}{sps} | {ratio} | {mem} | {own} | {r['load_s']} | "
                     f"{r['identical']} ({r.get('replaced', '-')}) | {r.get('sqnr_db_vs_tp1', '-')} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", required=True)
    ap.add_argument("--base", required=True, help="ComfyUI --base-directory with models/ and custom_nodes/ (pack linked)")
    ap.add_argument("--front-end", required=True, help="a folder with an index.html (the frontend package is not needed)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", default="h3_full_int8.safetensors", help="file in BASE/models/diffusion_models")
    ap.add_argument("--half-ckpt", default="h3_half_int8.safetensors", help="file in BASE/models/diffusion_models for variant 'half'")
    ap.add_argument("--cond", default="h3_full_cond.safetensors", help="file in BASE/models/h3_conditioning")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU profile of the 3rd model call per server (OUT/profile/)")
    ap.add_argument(
        "--tp-sizes",
        default="1,2",
        help="configurations in order, e.g. 1,2,2:bf16+fnorm,1:half+pack. Variant parts, joined with +: ENV_PARTS, FLAG_PARTS "
        "and NUMBERED_PARTS in this file, sdpa (SDPA attention), half (one GPU running a TP2 rank's half-width model, no "
        "communication), pack (tp 1 only: the pack active on one GPU, TP2_WORLD_SIZE=1), easycache (ComfyUI's EasyCache node)",
    )
    ap.add_argument("--resolutions", default="832x480,1344x768")
    ap.add_argument("--memory-resolutions", default="1600x896,1920x1088", help="TP-only memory runs: WxH or WxHxFRAMES")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--memory-steps", type=int, default=2)
    ap.add_argument("--frames", type=int, default=124)
    ap.add_argument("--attn", default="ck", help="TP2_ATTN_BACKEND for TP ranks (TP1 gets the same via --use-ck-attention)")
    ap.add_argument("--comfy-args", default="--highvram --disable-async-offload --use-ck-attention")
    ap.add_argument("--cap-gib", type=float, help="every process as if on a card of this many GiB (see the docstring)")
    ap.add_argument("--one-gpu", action="store_true", help="every rank on GPU 0, their group over gloo (memory real, speed not)")
    args = ap.parse_args(argv)
    for name in ("tp_sizes", "resolutions", "memory_resolutions"):  # "2" or "2:bf16" (TP2_REDUCE_DTYPE=bf16); WxH
        setattr(args, name, [x.strip() for x in getattr(args, name).split(",") if x.strip()])
    if args.cap_gib:
        need_mps()
    link_nodes(args.base, {"tp2_bench_profiler": BENCH_NODE})  # the profile, the one-GPU mode's group
    rows = asyncio.run(main_async(args))
    sqnr_vs_tp1(rows)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(table(rows))
    for path in sorted(glob.glob(os.path.join(args.out, "profile", "*", "*.txt"))):
        with open(path) as f:
            print(f"{os.path.relpath(path, args.out)}: " + "".join(f.readlines()[:2]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
