#!/usr/bin/env python3
"""The whole video as a user waits for it: a bundled text-to-video-with-audio workflow, unchanged, on real ComfyUI servers.

    python scripts/bench/whole_video.py --comfyui DIR --base DIR --front-end DIR --out DIR [--configs tp1,tp2] [--one-gpu]
        [--workflow h3_tp2_t2v_832x480] [--fast] [--steps N] [--frames N] [--size WxH] [--prompts cold,warm] [--tiny]
        [--host-hold-gib G]

BASE's models/ holds the bundled workflows' four files (scripts/bench/make_models.py). Configs (parse_config), side by
side, each on its own servers; `@G` caps each process at G GiB (CUDA MPS's per-process limit; without MPS the script
stops at once). --host-hold-gib G: G GiB of the host held by another process (process_memory.hold_host; 63 of a 128 GiB
machine leave what a 64 GB machine has). Prompts: cold (as shipped), warm (new text and seed), any other name: as warm.
Per prompt and process: wall time per phase (spans between `executing` events), nvidia-smi peak, the pack's capacity
lines, peak host RSS (and anonymous memory per phase), the host memory as each node starts (the profiler node's
`tp2-bench host` lines: ComfyUI's pinned copies per model), models (re)loaded, the MP4's size and sha256. Writes
OUT/whole_video.jsonl and OUT/whole_video_table.md (each phase's ratio to stock TP1).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.metadata
import json
import os
import re
import statistics
import subprocess
import sys

import aiohttp
import torch
from bench_comfy import BENCH_NODE, link_nodes, log_since, pack_lines, serving, step_times, submit  # beside this file
from make_models import FIXTURES, ROOT, TINY_ENV
from process_memory import ProcessSampler, need_mps

PHASES = {
    "UNETLoader": "load", "CLIPLoader": "load", "VAELoader": "load", "MiniMaxH3ImageToVideo": "text encode",
    "KSampler": "sampling", "VAEDecode": "video decode", "VAEDecodeAudio": "audio decode",
    "CreateVideo": "mux and save", "SaveVideo": "mux and save",
}  # fmt: skip
PHASE_ORDER = ("load", "text encode", "sampling", "video decode", "audio decode", "mux and save", "other")
FAST = {"TP2_REDUCE_DTYPE": "bf16", "TP2_SEQUENCE_PARALLEL": "1", "TP2_SP_FUSED_NORM": "1"}  # the launcher's --fast
LOAD_LINE = re.compile(r"Requested to load (\w+)")
WARM_TEXT = " The camera slowly pans left as the fox stops and looks back."


def parse_config(config: str) -> tuple[int, bool, float | None, list[str]]:
    """'tp2@22' -> (2, True, 22.0, []): tp_size, the pack active, the cap, ComfyUI flags; 'tp1' -> (1, False, None, []):
    stock ComfyUI; 'tp1pack' -> (1, True, None, []): the pack at tp_size 1 (its kernels, no collectives);
    'tp2+fast-disk+cache-none' -> (2, True, None, ['--fast-disk', '--cache-none']): ComfyUI arguments of its servers."""
    m = re.fullmatch(r"tp(\d+)(pack)?(?:@(\d+(?:\.\d+)?))?((?:\+[a-z][a-z0-9-]*)*)", config)
    if not m or int(m.group(1)) < 1:
        raise SystemExit(f"unknown config {config!r}: use tpN, tp1pack or either with @GIB and +FLAGs (e.g. tp1,tp2@22+fast-disk)")
    tp = int(m.group(1))
    return tp, tp > 1 or bool(m.group(2)), float(m.group(3)) if m.group(3) else None, ["--" + f for f in config.split("+")[1:]]


def config_tag(config: str) -> str:
    return config.replace("@", "_cap").replace("+", "_")


def bundled_workflow(args, tag: str, config: str) -> dict:
    """The bundled API workflow as shipped; warm: another text and seed; --tiny/--steps/--frames override sizes."""
    with open(os.path.join(ROOT, "workflows", "api", f"{args.workflow}.json")) as f:
        wf = json.load(f)
    for node in wf.values():
        inputs, kind = node["inputs"], node["class_type"]
        if kind == "MiniMaxH3ImageToVideo":
            if tag != "cold":
                inputs["prompt"] += WARM_TEXT + (f" ({tag})" if tag != "warm" else "")
            if args.tiny:
                inputs.update(width=64, height=64, length=5)
            if args.frames:
                inputs["length"] = args.frames
            if args.size:
                inputs["width"], inputs["height"] = (int(x) for x in args.size.split("x"))
        elif kind == "KSampler":
            if tag != "cold":
                inputs["seed"] += 1 + args.prompts.index(tag)
            if args.steps or args.tiny:
                inputs["steps"] = args.steps or 2
        elif kind == "SaveVideo":
            inputs["filename_prefix"] = f"video/{config_tag(config)}_{tag}"
    return wf


def phase_spans(events: list[tuple[float, str, dict]], classes: dict[str, str]) -> list[tuple[str, float, float]]:
    """(phase, start, end) of every node that ran, from one server's `executing` events."""
    marks = [(t, d.get("node")) for t, kind, d in events if kind == "executing"]
    return [(PHASES.get(classes.get(node, ""), "other"), t, t_next) for (t, node), (t_next, _) in zip(marks, marks[1:]) if node is not None]


def phases(events: list[tuple[float, str, dict]], classes: dict[str, str]) -> dict:
    """Per-phase seconds from one server's event stream (node spans between `executing` events)."""
    start = next((t for t, kind, _ in events if kind == "execution_start"), None)
    marks = [(t, d.get("node")) for t, kind, d in events if kind == "executing"]
    out = {p: 0.0 for p in PHASE_ORDER}
    for phase, t, t_next in phase_spans(events, classes):
        out[phase] += t_next - t
    end = next((t for t, node in marks if node is None), None) or next((t for t, kind, _ in events if kind == "execution_success"), None)
    out = {k: round(v, 2) for k, v in out.items()}
    out["whole prompt"] = round(end - start, 2) if start and end else None
    steps = step_times(events, next((n for n, c in classes.items() if c == "KSampler"), None))
    per_step = [b - a for a, b in zip(steps, steps[1:])]
    out["s/step"] = round(statistics.median(per_step), 3) if per_step else None
    return out


async def run_prompt(session, servers, wf, sampler: ProcessSampler) -> list[dict]:
    hists, events, log_at, t0, t1 = await submit(session, servers, wf, linger=0.6)  # one more sample of every process after the end
    classes = {n: node["class_type"] for n, node in wf.items()}
    results = []
    for s, h, ev, at in zip(servers, hists, events, log_at):
        said = log_since(s["log"], at)
        errors = [m.get("exception_message", "")[:1500] for k, m in h["status"].get("messages", []) if k == "execution_error"]
        videos = [
            i for o in h.get("outputs", {}).values() for i in o.get("images", []) + o.get("videos", []) if i["filename"].endswith(".mp4")
        ]
        mp4 = os.path.join(s["dir"], "output", videos[0]["subfolder"], videos[0]["filename"]) if videos else None
        pid_ = s["proc"].pid
        gib = lambda what, scale: None if (v := sampler.peak(pid_, what, t0, t1 + 0.6)) is None else round(v / scale, 2)  # noqa: E731
        by_phase, anon_by_phase = {}, {}
        for phase, a, b in phase_spans(ev, classes):
            for what, into, scale in (("gpu_mib", by_phase, 1024), ("RssAnon", anon_by_phase, 2**20)):
                v = sampler.peak(pid_, what, a, b + 0.6)
                if v is not None:
                    into[phase] = max(into.get(phase, 0.0), round(v / scale, 2))
        results.append({
            "server": s["name"], "ok": not errors, "error": errors[0] if errors else None, **phases(ev, classes),
            "gpu_peak_gib": gib("gpu_mib", 1024), "gpu_peak_gib_by_phase": by_phase, "host_peak_rss_gib": gib("VmRSS", 2**20),
            "host_peak_anon_gib": gib("RssAnon", 2**20), "host_peak_file_gib": gib("RssFile", 2**20),
            "host_peak_shmem_gib": gib("RssShmem", 2**20), "host_anon_gib_by_phase": anon_by_phase,
            "host_at_node_start": host_lines(said, classes),
            "loaded": LOAD_LINE.findall(said), "mp4_bytes": os.path.getsize(mp4) if mp4 else None,
            "mp4_sha256": hashlib.sha256(open(mp4, "rb").read()).hexdigest()[:16] if mp4 else None,
            "pack_log": pack_lines(said),
        })  # fmt: skip
    return results


def host_lines(said: str, classes: dict[str, str]) -> list[dict]:
    """The profiler node's `tp2-bench host node=ID {...}` lines in a server's log text: [{"before": class or "end", ...}]."""
    found = re.findall(r"tp2-bench host node=(\S+) (\{.*\})", said)
    return [{"before": classes.get(node, "end" if node == "None" else node), **json.loads(js)} for node, js in found]


def environment(args) -> dict:
    """The pack's commit, GPU 0's name and driver, torch's and comfy-kitchen's versions (the servers run this Python)."""
    smi = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader", "-i", "0"]
    try:
        gpu = subprocess.run(smi, capture_output=True, text=True, timeout=30).stdout.strip()
    except (FileNotFoundError, subprocess.TimeoutExpired):
        gpu = "none (CPU)"
    return {"commit": args.commit, "gpu": gpu, "torch": torch.__version__, "comfy_kitchen": importlib.metadata.version("comfy-kitchen")}


async def main_async(args) -> list[dict]:
    sampler, rows = ProcessSampler(), []
    env = environment(args)
    print(json.dumps({"environment": env}), flush=True)
    out = open(os.path.join(args.out, "whole_video.jsonl"), "a")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for config in args.configs:
                tp, pack, cap, config_flags = parse_config(config)
                extra = dict(TINY_ENV if args.tiny else {}, TP2_BENCH_HOST_LOG="1", **(FAST if args.fast and pack else {}))
                if args.one_gpu and pack:
                    extra["TP2_BENCH_GLOO_ON_CUDA"] = "1"
                flags = [*(["--cpu"] if args.tiny else []), *args.comfy_args.split(), *config_flags]
                names = [f"{config_tag(config)}_rank{r}" if tp > 1 else config_tag(config) for r in range(tp)]
                where = (os.path.join(args.out, "run"), names, "{}/comfyui.log", pack, args.one_gpu)
                cap = None if args.tiny else cap
                async with serving(session, args, config, *where, extra, flags, 900, cap, args.host_hold_gib) as (servers, gpu_limit):
                    sampler.pids.update(s["proc"].pid for s in servers)
                    for tag in args.prompts:
                        results = await run_prompt(session, servers, bundled_workflow(args, tag, config), sampler)
                        shas = {r["mp4_sha256"] for r in results}
                        row = {"config": config, "prompt": tag, "workflow": args.workflow, "one_gpu": args.one_gpu, "fast": args.fast,
                               "host_hold_gib": args.host_hold_gib, "size": args.size, "frames": args.frames, "steps": args.steps,
                               "gpu_limit": gpu_limit, "ranks_identical": len(shas) == 1 and None not in shas, "results": results,
                               "environment": env}  # fmt: skip
                        rows.append(row)
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                        print(json.dumps({k: v for k, v in row.items() if k != "environment"}), flush=True)
    finally:
        sampler.stop()
        out.close()
    return rows


def table(rows: list[dict]) -> str:
    """One line per config and prompt (rank 0's phases; memory as the max over ranks), TP1/TPn beside each phase."""
    cols = ("load", "text encode", "sampling", "s/step", "video decode", "audio decode", "mux and save", "whole prompt")
    base = {r["prompt"]: r["results"][0] for r in rows if parse_config(r["config"])[:3] == (1, False, None)}
    lines = ["| config | prompt | " + " | ".join(cols) + " | GPU peak GiB (max rank) | host RSS GiB (anon / file) | reloaded | ranks identical |",
             "|" + "---|" * (len(cols) + 6)]  # fmt: skip
    for r in rows:
        res, ref = r["results"][0], base.get(r["prompt"])
        if not res["ok"]:
            lines.append(f"| {r['config']} | {r['prompt']} | error: {res['error'][:200]} |")
            continue

        def cell(c):
            v = res.get(c)
            if v is None:
                return "-"
            ratio = ref.get(c) / v if ref and ref is not res and ref.get(c) and v else None
            return f"{v:g}" + (f" ({ratio:.2f}x)" if ratio else "")

        peak = lambda k: max((x[k] for x in r["results"] if x[k] is not None), default=None)  # noqa: E731
        rss = f"{peak('host_peak_rss_gib')} ({peak('host_peak_anon_gib')} / {peak('host_peak_file_gib')})"
        reloaded = sorted({m for x in r["results"] for m in x["loaded"]})
        lines.append(f"| {r['config']} | {r['prompt']} | " + " | ".join(cell(c) for c in cols)
                     + f" | {peak('gpu_peak_gib')} | {rss} | {', '.join(reloaded) or 'none'} | {r['ranks_identical']} |")  # fmt: skip
    return "\n".join(lines)


def _commit() -> str:
    git = ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]
    try:
        return subprocess.run(git, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", required=True)
    ap.add_argument("--base", required=True, help="ComfyUI --base-directory with the four models in models/")
    ap.add_argument("--front-end", required=True, help="a folder with an index.html (the frontend package is not needed)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="tp1,tp2", type=lambda s: s.split(","), help="tpN or tpN@GIB, comma-separated")
    ap.add_argument("--workflow", default="h3_tp2_t2v_832x480", help="a bundled workflow in workflows/api/")
    ap.add_argument("--one-gpu", action="store_true", help="every rank on GPU 0, gloo (the one-GPU measuring mode)")
    ap.add_argument("--fast", action="store_true", help="the TP ranks with the launcher's --fast settings")
    ap.add_argument("--steps", type=int, help="override the workflow's steps")
    ap.add_argument("--frames", type=int, help="override the workflow's length")
    ap.add_argument("--size", help="override the workflow's WIDTHxHEIGHT (e.g. 1920x1088)")
    ap.add_argument(
        "--prompts", default="cold,warm", type=lambda s: s.split(","), help="cold, warm (or any other name: a new text and seed), in order"
    )
    ap.add_argument("--host-hold-gib", type=float, help="GiB of host memory another process holds (63 of 128: a 64 GB machine)")
    ap.add_argument("--comfy-args", help="ComfyUI arguments for every server (default --use-ck-attention; none with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="CPU, the tests' stand-in models, 64x64x5, 2 steps")
    ap.add_argument("--commit", default=_commit(), help="the pack's commit, recorded in every row")
    args = ap.parse_args(argv)
    if any([parse_config(c)[2] for c in args.configs]) and not args.tiny:  # every config checked
        need_mps()
    if args.comfy_args is None:
        args.comfy_args = "" if args.tiny else "--use-ck-attention"
    args.base, args.out = os.path.abspath(args.base), os.path.abspath(args.out)
    links = {"minimax-h3-tp2": ROOT, "tp2_bench_profiler": BENCH_NODE}  # the latter: the one-GPU mode's gloo group
    if args.tiny:  # the test-only nodes that make ComfyUI build the small VAE and the tiny encoder
        links.update({fx: os.path.join(FIXTURES, fx) for fx in ("h3_small_vae", "h3_tiny_text_encoder")})
    link_nodes(args.base, links)
    os.makedirs(args.out, exist_ok=True)
    rows = asyncio.run(main_async(args))
    print(table(rows), flush=True)
    with open(os.path.join(args.out, "whole_video_table.md"), "w") as f:
        f.write(table(rows) + "\n")
    return 0 if rows and all(x["ok"] for r in rows for x in r["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
