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
each plus the serial parts. Every rep runs twice, alternating: as ComfyUI runs it (the fresh output buffer's pages
mapped at the decode's own writes) and with the buffer paged in beside the decode (tp2.host_prefault, as the pack
does on every rank); and the copy of one output's worth of frames from the GPU into a fresh host buffer is timed
against the same copy into a mapped one (the page faults alone). The GPU peak (torch's live tensors: weights, latent,
the decode in flight) says what a card must hold for the decode at that size. JSON on stdout and in OUT/vae_decode_profile.json.
--tiny: CPU, the 2-layer decoder.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from tp2.host_prefault import populated_ahead  # noqa: E402


def rounds(times: list[float], tp_size: int) -> float:
    """The critical path of items dealt round-robin, a round of tp_size at a time waiting for its slowest."""
    return sum(max(times[i : i + tp_size]) for i in range(0, len(times), tp_size))


def copy_into_fresh_and_mapped(shape, device) -> dict:
    """Seconds to copy one output's worth of frames from `device` into a fresh host buffer, then into the same
    buffer again (its pages mapped by then): the difference is the page faults."""
    src = torch.rand(shape, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out, dst = {}, torch.empty(shape)
    for key in ("fresh_s", "mapped_s"):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        out[key] = round(time.perf_counter() - t0, 4)
    return {"output_mb": round(dst.numel() * 4 / 1e6), **out}


def profile_once(vae, z, prefault: bool = False) -> dict:
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
        if z.is_cuda:
            torch.cuda.reset_peak_memory_stats(z.device)
        t0 = time.perf_counter()
        with torch.no_grad(), populated_ahead(out if prefault else None, dim=2) as ahead:
            vae.decode(z, output_buffer=out)
        sync()
        total = time.perf_counter() - t0
    finally:
        del vae._adaptive_decode, vae._decode_pixels
    peak = torch.cuda.max_memory_allocated(z.device) / 2**30 if z.is_cuda else None  # weights, latent and one chunk's decode
    return {"total": total, **spans, "ahead": str(ahead) if prefault else None, "gpu_peak_gib": peak}


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
        z = torch.randn(1, 24, t_lat, h // 16, w // 16, generator=torch.Generator().manual_seed(1)).to(
            device, vae.post_quant_conv.weight.dtype
        )
        profile_once(vae, z)  # warm-up
        runs = {False: [], True: []}
        for _ in range(a.reps):
            for prefault in (False, True):
                runs[prefault].append(profile_once(vae, z, prefault))
        copies = copy_into_fresh_and_mapped(vae.decode_output_shape(z.shape), device)
        for prefault in (False, True):
            best = min(runs[prefault], key=lambda r: r["total"])
            tiles, chunks, n = sum(best["tile"]), sum(best["chunk"]), a.tp_size
            serial_outside, blend_inside = best["total"] - chunks, chunks - tiles
            chunk_rr = rounds(best["chunk"], n) + serial_outside
            tile_rr = rounds(best["tile"], n) + blend_inside + serial_outside
            rows.append({
                "resolution": res, "host_output": best["ahead"] or "mapped at the decode's writes (ComfyUI as is)",
                "latent": list(z.shape), "chunks": len(best["chunk"]), "tiles": len(best["tile"]),
                "total_s": [round(r["total"], 3) for r in runs[prefault]], "best_total_s": round(best["total"], 3),
                "gpu_peak_gib": None if best["gpu_peak_gib"] is None else round(best["gpu_peak_gib"], 2),
                "tile_decodes_s": round(tiles, 3), "blend_inside_chunks_s": round(blend_inside, 3), "outside_chunks_s": round(serial_outside, 3),
                "tile_s_median": round(statistics.median(best["tile"]), 4), "tile_s_max": round(max(best["tile"]), 4),
                f"tp{n}_chunk_round_robin_s": round(chunk_rr, 3), f"tp{n}_chunk_round_robin_x": round(best["total"] / chunk_rr, 2),
                f"tp{n}_tile_round_robin_s": round(tile_rr, 3), f"tp{n}_tile_round_robin_x": round(best["total"] / tile_rr, 2),
                "copy_of_the_output_into_host_s": copies,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "vae_decode_profile.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (tiny)", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
