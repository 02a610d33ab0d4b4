#!/usr/bin/env python3
"""Where one GPU's H3 video decode spends its time, and what that predicts for a split over tp_size ranks.

    python scripts/bench/vae_decode_profile.py [--device-dir .device] [--resolutions 832x480,1344x768] [--frames 124]
                                               [--reps 3] [--tp-size 2] [--out DIR] [--tiny]

One process, no TP: ComfyUI's own full-size MiniMaxH3VideoVAE (random fp16 weights, scripts/bench/vae_decode_bench.py
builds it) decodes a random latent as ComfyUI's VAE wrapper calls it (fp32 output buffer on the CPU), with a
synchronised timer around every chunk decode (`_adaptive_decode`) and every tile decode (`_decode_pixels`). Split:
tiles (the ViT: the parallel part), the blend between a chunk's tiles, and everything outside the chunk decodes
(the blend between chunks, the fp32 finalisation, the copy into the CPU buffer: serial on every rank today).
Predicted critical path over tp_size ranks, communication left out: chunks round-robin (what nodes/vae_decode.py
does: a round of tp_size chunks waits for its slowest) or tiles round-robin (every chunk's tiles in one list),
each plus the serial parts. JSON on stdout and in OUT/vae_decode_profile.json. --tiny: CPU, the 2-layer decoder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from vae_decode_bench import build_vae, import_pack, unpack_device  # noqa: E402


def rounds(times: list[float], tp_size: int) -> float:
    """The critical path of items dealt round-robin, a round of tp_size at a time waiting for its slowest."""
    return sum(max(times[i : i + tp_size]) for i in range(0, len(times), tp_size))


def profile_once(vae, z) -> dict:
    spans = {"chunk": [], "tile": []}
    sync = torch.cuda.synchronize if z.is_cuda else (lambda: None)

    def timed(fn, key):
        def run(x):
            sync()
            t0 = time.perf_counter()
            y = fn(x)
            sync()
            spans[key].append(time.perf_counter() - t0)
            return y

        return run

    vae._adaptive_decode, vae._decode_pixels = timed(vae._adaptive_decode, "chunk"), timed(vae._decode_pixels, "tile")
    try:
        out = torch.empty(vae.decode_output_shape(z.shape), dtype=torch.float32)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            vae.decode(z, output_buffer=out)
        sync()
        total = time.perf_counter() - t0
    finally:
        del vae._adaptive_decode, vae._decode_pixels
    return {"total": total, **spans}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_DIR", os.path.expanduser("~/ComfyUI")))
    ap.add_argument("--device-dir")
    ap.add_argument("--resolutions", default=None)
    ap.add_argument("--frames", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args(argv)
    a.resolutions = a.resolutions or ("96x64" if a.tiny else "832x480,1344x768")
    a.frames = a.frames or (56 if a.tiny else 124)
    if a.device_dir:
        a.comfyui = unpack_device(a.device_dir)
    h3_vae, _ = import_pack(a.comfyui, a.tiny)
    device = torch.device("cpu") if a.tiny else torch.device("cuda", 0)
    vae = build_vae(h3_vae, device, torch.float32 if a.tiny else torch.float16)
    rows = []
    for res in a.resolutions.split(","):
        w, h = map(int, res.split("x"))
        t_lat = max(1, (a.frames - 5) // 17 * 5 + 2)  # ComfyUI's H3 VAE downscale formula (comfy/sd.py), as the decode bench
        z = torch.randn(1, 24, t_lat, h // 16, w // 16, generator=torch.Generator().manual_seed(1)).to(device, vae.post_quant_conv.weight.dtype)
        profile_once(vae, z)  # warm-up
        runs = [profile_once(vae, z) for _ in range(a.reps)]
        best = min(runs, key=lambda r: r["total"])
        tiles, chunks, n = sum(best["tile"]), sum(best["chunk"]), a.tp_size
        serial_outside, blend_inside = best["total"] - chunks, chunks - tiles
        chunk_rr = rounds(best["chunk"], n) + serial_outside
        tile_rr = rounds(best["tile"], n) + blend_inside + serial_outside
        rows.append({
            "resolution": res, "latent": list(z.shape), "chunks": len(best["chunk"]), "tiles": len(best["tile"]),
            "total_s": [round(r["total"], 3) for r in runs], "best_total_s": round(best["total"], 3),
            "tile_decodes_s": round(tiles, 3), "blend_inside_chunks_s": round(blend_inside, 3), "outside_chunks_s": round(serial_outside, 3),
            "tile_s_median": round(statistics.median(best["tile"]), 4), "tile_s_max": round(max(best["tile"]), 4),
            f"tp{n}_chunk_round_robin_s": round(chunk_rr, 3), f"tp{n}_chunk_round_robin_x": round(best["total"] / chunk_rr, 2),
            f"tp{n}_tile_round_robin_s": round(tile_rr, 3), f"tp{n}_tile_round_robin_x": round(best["total"] / tile_rr, 2),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "vae_decode_profile.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (tiny)", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
