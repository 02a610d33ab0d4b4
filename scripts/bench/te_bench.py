#!/usr/bin/env python3
"""H3's text encoder at full size on one GPU: load, cold and warm encode, GPU and host memory; and each TP rank's
share built on its own (its weights' GPU memory and host peak), without collectives.

    python scripts/bench/te_bench.py ENCODER.safetensors --comfyui DIR [--tp-size 2] [--out results.json]

Mode "tp1": ComfyUI's own CLIPLoader path (comfy.sd.load_clip, type minimax), then CLIPTextEncode's calls twice.
Mode "rank R": this pack's shard-on-read (tp2.rank_cache.read_rank_slices, no cache) and ComfyUI's build at the rank's width (the
`qwen3vl_32b_model_config` override the pack passes), loaded to the GPU; no encode (it needs the other ranks).
Each mode runs in a fresh process (the script calls itself), so each peak is its own. JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "A red fox trots through fresh snow in a quiet birch forest at dawn, breath steaming, soft crunch of footsteps and distant birdsong."


def _peak_rss_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20


def _import_comfy(comfyui: str):
    sys.path.insert(0, comfyui)
    sys.path.insert(0, ROOT)
    os.chdir(comfyui)
    import comfy.sd  # noqa: F401 - ComfyUI's own defaults (GPU, dynamic VRAM as it decides)

    return comfy


def run_tp1(path: str, comfyui: str) -> dict:
    comfy = _import_comfy(comfyui)
    import torch

    t0 = time.monotonic()
    clip = comfy.sd.load_clip([path], clip_type=comfy.sd.CLIPType.MINIMAX)
    load_s = time.monotonic() - t0
    out = {"mode": "tp1", "load_s": round(load_s, 2)}
    for which in ("cold", "warm"):
        torch.cuda.synchronize()
        t0 = time.monotonic()
        cond = clip.encode_from_tokens_scheduled(clip.tokenize(PROMPT))
        torch.cuda.synchronize()
        out[f"encode_{which}_s"] = round(time.monotonic() - t0, 3)
    out["tokens"] = int(cond[0][0].shape[1])
    out["cond_dtype"] = str(cond[0][0].dtype)
    out["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    out["gpu_now_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    out["host_peak_rss_gib"] = round(_peak_rss_gib(), 2)
    return out


def run_rank(path: str, comfyui: str, tp_size: int, rank: int) -> dict:
    comfy = _import_comfy(comfyui)
    import comfy.model_management as mm
    import torch

    from tp2.checkpoint import CheckpointLayout
    from tp2.rank_cache import read_rank_slices
    from tp2.te_plan import resolve_te_plan

    t0 = time.monotonic()
    plan = resolve_te_plan(CheckpointLayout.from_file(path), tp_size)
    sd, metadata, _ = read_rank_slices(path, plan.tensors, plan.fingerprint(), rank, plan.tp_size, " of the text encoder")
    sd, metadata = comfy.utils.convert_old_quants(sd, model_prefix="", metadata=metadata)
    clip = comfy.sd.load_text_encoder_state_dicts([sd], None, comfy.sd.CLIPType.MINIMAX, {"qwen3vl_32b_model_config": plan.local_config()})
    del sd
    mm.load_models_gpu([clip.patcher], force_full_load=True)
    torch.cuda.synchronize()
    return {
        "mode": f"rank {rank} of {tp_size}",
        "load_s": round(time.monotonic() - t0, 2),
        "gpu_weights_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
        "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "host_peak_rss_gib": round(_peak_rss_gib(), 2),
        "plan": plan.summary(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("encoder")
    ap.add_argument("--comfyui", required=True)
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # internal: one measurement in this process
    a = ap.parse_args(argv)
    if a.mode == "tp1":
        print(json.dumps(run_tp1(a.encoder, a.comfyui)), flush=True)
        return 0
    if a.mode is not None:
        print(json.dumps(run_rank(a.encoder, a.comfyui, a.tp_size, int(a.mode))), flush=True)
        return 0
    size = os.path.getsize(a.encoder) / 2**30
    print(json.dumps({"encoder": os.path.basename(a.encoder), "file_gib": round(size, 2)}), flush=True)
    for mode in ["tp1", *map(str, range(a.tp_size))]:
        cmd = [sys.executable, os.path.abspath(__file__), a.encoder, "--comfyui", a.comfyui, "--tp-size", str(a.tp_size), "--mode", mode]
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        print(lines[-1] if lines and done.returncode == 0 else json.dumps({"mode": mode, "error": done.stderr[-1500:]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
