#!/usr/bin/env python3
"""Every rank of a TP set on ONE GPU (the one-GPU measuring mode): each rank's memory is real, its speed is not.

    python scripts/bench/one_gpu_ranks.py --comfyui DIR --base DIR --clip FILE --out DIR [--tp-size 2] [--cap-gib 22]

Starts one plain ComfyUI (pack inactive: the TP1 reference) and tp_size ranks, all with CUDA_VISIBLE_DEVICES=0,
the ranks' group over gloo (TP2_BENCH_GLOO_ON_CUDA=1, read by scripts/bench/profiler_node: NCCL refuses two ranks on one GPU) and, with --cap-gib, each
the GPU made a card of that much per process (scripts/bench/gpu_ballast.py holds the rest: the ranks and the plain
server share cap x (tp_size + 1) GiB). Runs the text-encoder workflow (CLIPLoader type
minimax -> CLIPTextEncode -> SaveH3Conditioning) twice on every server (cold: load and encode; warm: another text) and reports, per process: peak GPU memory
(nvidia-smi's per-process `used_memory`, sampled every 0.2 s), peak host RSS (VmHWM), the encode wall time (not a
speed: gloo moves CUDA tensors through host memory), whether the ranks' conditioning files are byte-identical,
and the ranks' relative difference from the plain server's. JSON lines on stdout and in OUT/one_gpu_ranks.jsonl.
BASE is a ComfyUI --base-directory with the pack in custom_nodes/ and the encoder in models/text_encoders/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid

from bench_comfy import free_port, link_bench_node  # this folder: scripts/bench
from process_memory import ProcessSampler, hold_all_but, stop_all

PROMPT = (
    "A red fox trots through fresh snow in a quiet birch forest at dawn, breath steaming, soft crunch of footsteps and distant birdsong."
)


def start(args, name: str, env_extra: dict) -> dict:
    d = os.path.join(args.out, name)
    for sub in ("output", "temp", "user"):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TP2_", "MASTER_"))}
    env.update(CUDA_VISIBLE_DEVICES="0", **env_extra)
    cmd = [sys.executable, "main.py", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", args.base,
           "--output-directory", f"{d}/output", "--temp-directory", f"{d}/temp", "--user-directory", f"{d}/user",
           "--disable-auto-launch", "--disable-api-nodes", "--database-url", f"sqlite:///{d}/db.sqlite", *args.comfy_args.split()]  # fmt: skip
    log = open(os.path.join(d, "comfyui.log"), "ab")
    proc = subprocess.Popen(cmd, cwd=args.comfyui, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return {"name": name, "proc": proc, "port": port, "dir": d}


def call(server: dict, path: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{server['port']}{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"{}")


def wait_ready(servers, timeout_s=600):
    deadline = time.monotonic() + timeout_s
    for s in servers:
        while True:
            try:
                call(s, "/system_stats")
                break
            except OSError:
                if s["proc"].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{s['name']} did not start; see {s['dir']}/comfyui.log") from None
                time.sleep(0.5)


def run_prompt(servers, clip: str, tag: str) -> list[dict]:
    text = PROMPT if tag == "cold" else f"{PROMPT} ({tag})"  # another text: the loaded encoder, a new encode
    wf = {
        "1": {"class_type": "CLIPLoader", "inputs": {"clip_name": clip, "type": "minimax", "device": "default"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": text}},
        "3": {"class_type": "SaveH3Conditioning", "inputs": {"conditioning": ["2", 0], "filename_prefix": f"cond_{tag}"}},
    }
    pid, t0 = str(uuid.uuid4()), time.monotonic()
    for s in servers:
        call(s, "/prompt", {"prompt": wf, "prompt_id": pid, "client_id": "one-gpu-bench"})
    done = []
    for s in servers:
        while True:
            h = call(s, f"/history/{pid}").get(pid)
            if h and h.get("status", {}).get("status_str") in ("success", "error"):
                break
            time.sleep(0.2)
        ok = h["status"]["status_str"] == "success"
        files = [i for o in h.get("outputs", {}).values() for i in o.get("conditioning", [])]
        path = os.path.join(s["dir"], "output", files[0]["subfolder"], files[0]["filename"]) if ok and files else None
        done.append({"server": s["name"], "ok": ok, "wall_s": round(time.monotonic() - t0, 2), "file": path,
                     "error": None if ok else str(h["status"].get("messages", []))[-800:]})  # fmt: skip
    return done


def compare(results: list[dict]) -> dict:
    import torch
    from safetensors.torch import load_file

    conds = {r["server"]: load_file(r["file"])["cond"] for r in results if r["file"]}
    ranks = [c for n, c in conds.items() if n.startswith("rank")]
    out = {"ranks_identical": all(torch.equal(c, ranks[0]) for c in ranks) if ranks else None}
    if "plain" in conds and ranks:
        ref = conds["plain"].double()
        out["rel_err_vs_plain"] = float((ranks[0].double() - ref).norm() / ref.norm())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--clip", required=True, help="file name in BASE/models/text_encoders")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--cap-gib", type=float)
    ap.add_argument("--comfy-args", default="", help="extra ComfyUI arguments for every server (e.g. --cpu for a dry run)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    link_bench_node(a.base)  # its node forms the ranks' group over gloo (TP2_BENCH_GLOO_ON_CUDA)
    master = free_port()
    rank_env = {"TP2_WORLD_SIZE": str(a.tp_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "TP2_BENCH_GLOO_ON_CUDA": "1"}
    ballast = hold_all_but(a.cap_gib, {0: a.tp_size + 1}) if a.cap_gib else []  # the ranks and the plain server
    servers = [start(a, f"rank{r}", dict(rank_env, TP2_RANK=str(r))) for r in reversed(range(a.tp_size))][::-1]
    servers.append(start(a, "plain", {}))
    mem = ProcessSampler()
    lines = []
    try:
        wait_ready(servers)
        for tag in ("cold", "warm"):
            results = run_prompt(servers, a.clip, tag)
            lines.append({"prompt": tag, "results": results, **compare(results)})
            print(json.dumps(lines[-1]), flush=True)
        for s in servers:
            with open(f"/proc/{s['proc'].pid}/status") as f:
                rss = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))
            lines.append(
                {
                    "server": s["name"],
                    "gpu_peak_mib": mem.peak(s["proc"].pid, "gpu_mib", 0, float("inf")),
                    "host_peak_rss_gib": round(rss / 2**20, 2),
                }
            )
            print(json.dumps(lines[-1]), flush=True)
    finally:
        mem.stop()
        for s in servers:
            s["proc"].terminate()
        stop_all(ballast)
        with open(os.path.join(a.out, "one_gpu_ranks.jsonl"), "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
