#!/usr/bin/env python3
"""The whole video as a user waits for it: a bundled text-to-video-with-audio workflow, unchanged, on real ComfyUI servers.

    python scripts/bench/whole_video.py --comfyui DIR --base DIR --front-end DIR --out DIR [--configs tp1,tp2] [--one-gpu]
        [--workflow h3_tp2_t2v_832x480] [--fast] [--steps N] [--frames N] [--size WxH] [--prompts cold,warm] [--tiny]
        [--host-hold-gib G]

BASE's models/ holds the bundled workflows' four files (scripts/bench/make_models.py). Configs, side by side, each on its
own servers: `tp1` stock ComfyUI, `tp1pack` the pack at tp_size 1, `tpN` N ranks (--one-gpu: all on GPU 0 over gloo;
memory real, speed not); `@G` (tp2@22) caps each process at G GiB (with --one-gpu under CUDA MPS's per-process limit
where its daemon is installed, else gpu_ballast.py: process_memory.confine_gpus; the row's gpu_limit says which); `+FLAG`
(tp2@22+fast-disk) adds ComfyUI's --FLAG to that config's servers. --host-hold-gib: G GiB of the host held by another process (host_ballast.py; 63 of a
128 GiB machine leave what a 64 GB machine has). Prompts: cold (as shipped), warm (new text and seed), any other name: as warm. Per prompt and process: wall time per phase (spans between `executing` events), nvidia-smi peak, the
pack's capacity lines, peak host RSS (and anonymous memory per phase), the host memory as each node starts (the profiler
node's `tp2-bench host` lines: ComfyUI's pinned copies per model), models (re)loaded, the MP4's size and sha256. Writes OUT/whole_video.jsonl and
OUT/whole_video_table.md (each phase's ratio to stock TP1). --tiny: CPU stand-ins, 64x64, 5 frames, 2 steps.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
import uuid

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from bench_comfy import BENCH_NODE, free_port, pack_lines, stop_servers, wait_ready  # noqa: E402
from make_models import FIXTURES, TINY_ENV  # noqa: E402
from process_memory import ProcessSampler, confine_gpus, hold_host, servers_per_gpu, stop_all  # noqa: E402

PHASES = {
    "UNETLoader": "load", "CLIPLoader": "load", "VAELoader": "load", "MiniMaxH3ImageToVideo": "text encode",
    "KSampler": "sampling", "VAEDecode": "video decode", "VAEDecodeAudio": "audio decode",
    "CreateVideo": "mux and save", "SaveVideo": "mux and save",
}  # fmt: skip
PHASE_ORDER = ("load", "text encode", "sampling", "video decode", "audio decode", "mux and save", "other")
FAST = {"TP2_REDUCE_DTYPE": "bf16", "TP2_SEQUENCE_PARALLEL": "1", "TP2_SP_FUSED_NORM": "1"}  # the launcher's --fast
LOAD_LINE = re.compile(r"Requested to load (\w+)")
WARM_TEXT = " The camera slowly pans left as the fox stops and looks back."


def parse_config(config: str) -> tuple[int, bool, float | None]:
    """'tp2@22' -> (2, True, 22.0): tp_size, the pack active, the cap; 'tp1' -> (1, False, None): stock ComfyUI;
    'tp1pack' -> (1, True, None): the pack at tp_size 1 (its kernels, no collectives). `+FLAG`s: config_flags."""
    m = re.fullmatch(r"tp(\d+)(pack)?(?:@(\d+(?:\.\d+)?))?((?:\+[a-z][a-z0-9-]*)*)", config)
    if not m or int(m.group(1)) < 1:
        raise SystemExit(f"unknown config {config!r}: use tpN, tp1pack or either with @GIB and +FLAGs (e.g. tp1,tp2@22+fast-disk)")
    tp = int(m.group(1))
    return tp, tp > 1 or bool(m.group(2)), float(m.group(3)) if m.group(3) else None


def config_flags(config: str) -> list[str]:
    """'tp2@22+fast-disk+cache-none' -> ['--fast-disk', '--cache-none']: ComfyUI arguments of that config's servers."""
    return ["--" + f for f in config.split("+")[1:]]


def start_servers(args, config: str, limit_env: dict[str, str]) -> list[dict]:
    tp, pack, cap = parse_config(config)
    master, servers = free_port(), []
    for r in reversed(range(tp)):
        tag = config.replace("@", "_cap").replace("+", "_")
        name = f"{tag}_rank{r}" if tp > 1 else tag
        d = os.path.join(args.out, "run", name)
        for sub in ("output", "temp", "user"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TP2_", "MASTER_")) or k == "TP2_CACHE_DIR"}
        env.update(TINY_ENV if args.tiny else {}, CUDA_VISIBLE_DEVICES="0" if args.one_gpu else str(r), TP2_BENCH_HOST_LOG="1", **limit_env)
        if pack:
            env.update(TP2_RANK=str(r), TP2_WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
                       TP2_PROMPT_TIMEOUT_S="900", TP2_TIMEOUT_S="900", **(FAST if args.fast else {}))  # fmt: skip
            if args.one_gpu:
                env["TP2_BENCH_GLOO_ON_CUDA"] = "1"
        cmd = [sys.executable, "main.py", "--listen", "127.0.0.1", "--port", str(free_port()), "--base-directory", args.base,
               "--output-directory", f"{d}/output", "--temp-directory", f"{d}/temp", "--user-directory", f"{d}/user",
               "--database-url", f"sqlite:///{d}/db.sqlite", "--disable-auto-launch", "--disable-api-nodes",
               "--front-end-root", args.front_end, *(["--cpu"] if args.tiny else []), *args.comfy_args.split(), *config_flags(config)]  # fmt: skip
        log = os.path.join(d, "comfyui.log")
        proc = subprocess.Popen(cmd, cwd=args.comfyui, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        servers.insert(0, {"name": name, "rank": r, "proc": proc, "port": int(cmd[cmd.index("--port") + 1]), "dir": d, "log": log})
    return servers


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
            inputs["filename_prefix"] = f"video/{config.replace('@', '_cap').replace('+', '_')}_{tag}"
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
    sampler = next((n for n, c in classes.items() if c == "KSampler"), None)
    first_seen: dict[int, float] = {}
    for t, kind, d in events:
        if kind == "progress" and d.get("node") == sampler:
            first_seen.setdefault(d["value"], t)
    steps = [first_seen[v] for v in sorted(first_seen)]
    per_step = [b - a for a, b in zip(steps, steps[1:])]
    out["s/step"] = round(statistics.median(per_step), 3) if per_step else None
    return out


async def run_prompt(session, servers, wf, sampler: ProcessSampler) -> list[dict]:
    pid, cids = str(uuid.uuid4()), [uuid.uuid4().hex for _ in servers]
    events: list[list] = [[] for _ in servers]
    log_at = [os.path.getsize(s["log"]) for s in servers]

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
    hists = []
    for s in servers:
        while True:
            async with session.get(f"http://127.0.0.1:{s['port']}/history/{pid}") as r:
                h = (await r.json()).get(pid)
            if h and h["status"].get("status_str") in ("success", "error"):
                hists.append(h)
                break
            if s["proc"].poll() is not None:
                raise RuntimeError(f"{s['name']} died:\n" + open(s["log"], errors="replace").read()[-4000:])
            await asyncio.sleep(0.2)
    t1 = time.time()
    await asyncio.sleep(0.6)  # one more sample of every process after the end
    for w in watchers:
        w.cancel()
    classes = {n: node["class_type"] for n, node in wf.items()}
    results = []
    for s, h, ev, at in zip(servers, hists, events, log_at):
        with open(s["log"], errors="replace") as f:
            f.seek(at)
            loaded = LOAD_LINE.findall(f.read())
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
            "host_at_node_start": host_lines(s["log"], at, classes),
            "loaded": loaded, "mp4_bytes": os.path.getsize(mp4) if mp4 else None,
            "mp4_sha256": hashlib.sha256(open(mp4, "rb").read()).hexdigest()[:16] if mp4 else None,
            "pack_log": pack_lines(s["log"], at),
        })  # fmt: skip
    return results


def host_lines(log: str, start: int, classes: dict[str, str]) -> list[dict]:
    """The profiler node's `tp2-bench host node=ID {...}` lines since `start`: [{"before": class or "end", ...}]."""
    with open(log, errors="replace") as f:
        f.seek(start)
        found = re.findall(r"tp2-bench host node=(\S+) (\{.*\})", f.read())
    return [{"before": classes.get(node, "end" if node == "None" else node), **json.loads(js)} for node, js in found]


def environment(args) -> dict:
    env = {"commit": args.commit}
    try:
        env["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader", "-i", "0"],
                                    capture_output=True, text=True, timeout=30).stdout.strip()  # fmt: skip
    except (FileNotFoundError, subprocess.TimeoutExpired):
        env["gpu"] = "none (CPU)"
    code = "import torch, importlib.metadata as m; print(torch.__version__, m.version('comfy-kitchen'))"
    try:
        env["torch"], env["comfy_kitchen"] = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split()
    except ValueError:
        pass
    return env


async def main_async(args) -> list[dict]:
    sampler, rows = ProcessSampler(), []
    env = environment(args)
    print(json.dumps({"environment": env}), flush=True)
    out = open(os.path.join(args.out, "whole_video.jsonl"), "a")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for config in args.configs:
                tp, _, cap = parse_config(config)
                ballast, limit_env, gpu_limit = [], {}, None
                if cap and not args.tiny:
                    ballast, limit_env, gpu_limit = confine_gpus(cap, servers_per_gpu(tp, args.one_gpu))
                    print(f"{config}: {gpu_limit}", flush=True)
                if args.host_hold_gib:
                    ballast.append(hold_host(args.host_hold_gib))
                servers = start_servers(args, config, limit_env)
                sampler.pids.update(s["proc"].pid for s in servers)
                try:
                    await wait_ready(session, [(s["proc"], s["port"], s["log"]) for s in servers], 900)
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
                    stop_servers([(s["proc"], s["port"], s["log"]) for s in servers])
                    stop_all(ballast)
    finally:
        sampler.stop()
        out.close()
    return rows


def table(rows: list[dict]) -> str:
    """One line per config and prompt (rank 0's phases; memory as the max over ranks), TP1/TPn beside each phase."""
    cols = ("load", "text encode", "sampling", "s/step", "video decode", "audio decode", "mux and save", "whole prompt")
    base = {r["prompt"]: r["results"][0] for r in rows if parse_config(r["config"]) == (1, False, None)}
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
    try:
        return subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
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
    for c in args.configs:
        parse_config(c)
    if args.comfy_args is None:
        args.comfy_args = "" if args.tiny else "--use-ck-attention"
    args.base, args.out = os.path.abspath(args.base), os.path.abspath(args.out)
    os.makedirs(os.path.join(args.base, "custom_nodes"), exist_ok=True)
    links = {"minimax-h3-tp2": ROOT, "tp2_bench_profiler": BENCH_NODE}  # the latter: the one-GPU mode's gloo group
    if args.tiny:  # the test-only nodes that make ComfyUI build the small VAE and the tiny encoder
        links.update({fx: os.path.join(FIXTURES, fx) for fx in ("h3_small_vae", "h3_tiny_text_encoder")})
    for name, target in links.items():
        link = os.path.join(args.base, "custom_nodes", name)
        if not os.path.lexists(link):
            os.symlink(target, link)
    os.makedirs(args.out, exist_ok=True)
    rows = asyncio.run(main_async(args))
    print(table(rows), flush=True)
    with open(os.path.join(args.out, "whole_video_table.md"), "w") as f:
        f.write(table(rows) + "\n")
    return 0 if rows and all(x["ok"] for r in rows for x in r["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
