#!/usr/bin/env python3
"""H3 video VAE decode, one GPU (TP1) against the split decode over two (TP2), in the same two processes.

    python scripts/bench/vae_decode_bench.py --comfyui DIR [--device-dir .device] [--resolutions 832x480,1344x768]
                                             [--frames 124] [--reps 3] [--out DIR] [--tiny]

Each rank (one process per GPU, CUDA_VISIBLE_DEVICES as the launcher sets it) builds ComfyUI's own full-size
`MiniMaxH3VideoVAE` with random fp16 weights (same seed on both) and the pack's real hook (nodes/vae_decode.py:
store agreement, NCCL broadcasts, ComfyUI's own blend). Per resolution: one split decode to warm up, TP1 (rank 0
decodes alone with ComfyUI's unhooked decode, rank 1 idle), then TP2 (both ranks, the hook); decode() is called as
ComfyUI's VAE wrapper calls it (fp16 latent on the GPU, fp32 output buffer on the CPU). Checks that the TP2 frames
equal TP1's exactly on both ranks; prints a table and writes vae_decode_bench.json under --out. --device-dir
unpacks what scripts/bench/stage.sh staged (ComfyUI source, wheels) into /tmp/tp2bench first. --tiny: CPU, gloo,
a 2-layer decoder, 96x64 (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_models import fill_random  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORK = "/tmp/tp2bench"


def unpack_device(device_dir: str) -> str:
    """ComfyUI and the wheels it needs, from scripts/bench/stage.sh's output (as scripts/bench.sh does); its path."""
    site, comfy = os.path.join(WORK, "site"), os.path.join(WORK, "ComfyUI")
    if not os.path.isdir(os.path.join(site, "comfy_kitchen")):
        os.makedirs(site, exist_ok=True)
        wheels = glob.glob(os.path.join(device_dir, "wheels", "*.whl"))
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", site, *wheels], check=True
        )
        subprocess.run(["tar", "-C", site, "-xJf", os.path.join(device_dir, "comfy_kitchen.tar.xz")], check=True)
        shutil.copytree(os.path.join(ROOT, "scripts", "bench", "avstub", "av"), os.path.join(site, "av"))  # ComfyUI imports PyAV
    if not os.path.isfile(os.path.join(comfy, "main.py")):
        os.makedirs(comfy, exist_ok=True)
        subprocess.run(["tar", "-C", comfy, "-xJf", os.path.join(device_dir, "comfyui.tar.xz")], check=True)
    sys.path.insert(0, site)
    return comfy


def import_pack(comfyui: str, tiny: bool):
    """ComfyUI's H3 VAE module and the pack's hook module (the pack imported as ComfyUI imports it: a package)."""
    sys.path.insert(0, comfyui)
    import comfy.cli_args

    comfy.cli_args.args.cpu = tiny
    import comfy.ldm.minimax.vae as h3_vae

    if tiny:
        import functools

        h3_vae.ViT3DDecoder = functools.partial(h3_vae.ViT3DDecoder, num_layers=2, heads=2, dim_head=32)
    pack = importlib.util.module_from_spec(importlib.util.spec_from_loader("tp2pack", loader=None, is_package=True))
    pack.__path__ = [ROOT]
    sys.modules["tp2pack"] = pack
    return h3_vae, importlib.import_module("tp2pack.nodes.vae_decode")


def build_vae(h3_vae, device: torch.device, dtype: torch.dtype):
    """The full VAE class with the encoder dropped (decode never uses it) and seeded random decoder weights."""
    with device:  # ComfyUI's ops leave parameters uninitialised: build in place, no host copy
        vae = h3_vae.MiniMaxH3VideoVAE()
    del vae.encoder, vae.quant_conv
    vae = vae.eval().to(device, dtype)
    fill_random(vae, seed=0, device=device.type if device.type == "cpu" else str(device))
    return vae


def rank_main(tp_rank: int, tp_size: int, port: int, args, queue) -> None:
    os.environ.update(
        TP2_RANK=str(tp_rank), TP2_WORLD_SIZE=str(tp_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TP2_TIMEOUT_S="600"
    )
    logging.basicConfig(level=logging.INFO, format=f"[rank {tp_rank}] %(name)s: %(message)s")
    h3_vae, vd = import_pack(args.comfyui, args.tiny)
    from tp2pack.nodes.lockstep import CURRENT
    from tp2pack.nodes.state import STATE
    from tp2pack.tp2.collectives import read_tp_env
    from tp2pack.tp2.session import TPSession

    device = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    dtype = torch.float32 if args.tiny else torch.float16
    STATE.env, STATE.device, STATE.prompt_timeout_s = read_tp_env(), device, 600.0
    STATE.session = TPSession(STATE.env, device)
    CURRENT.prompt_id, CURRENT.fingerprint = "vae-bench", "vae-bench"
    vae = build_vae(h3_vae, device, dtype)
    unhooked = type(vae).decode_temporal
    vd.install_parallel_vae_decode()
    rows = []
    for res in args.resolutions.split(","):
        w, h = map(int, res.split("x"))
        t_lat = max(1, (args.frames - 5) // 17 * 5 + 2)  # ComfyUI's H3 VAE downscale formula (comfy/sd.py)
        z = torch.randn(1, 24, t_lat, h // 16, w // 16, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        rows.append(measure(vae, vd, unhooked, z, tp_rank, STATE, CURRENT, args.reps) | {"resolution": res, "latent": list(z.shape)})
    queue.put((tp_rank, rows, attention_name()))
    STATE.session.close()


def measure(vae, vd, unhooked, z, tp_rank, STATE, CURRENT, reps) -> dict:
    def decode(split: bool):
        out = torch.empty(vae.decode_output_shape(z.shape), dtype=torch.float32)  # on the CPU, as ComfyUI's VAE.decode
        if not split:
            vae.decode_temporal = unhooked.__get__(vae)  # ComfyUI's own decode, this rank alone
        try:
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                vae.decode(z, output_buffer=out)
            sync()
            return out, time.perf_counter() - t0
        finally:
            vae.__dict__.pop("decode_temporal", None)

    def sync():
        if z.is_cuda:
            torch.cuda.synchronize()

    def barrier():
        torch.distributed.barrier(group=STATE.session.group.cpu_group)

    def peak_reset():
        if z.is_cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak() -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if z.is_cuda else 0.0

    decode(split=True)  # warm-up; forms the process group
    barrier()
    tp1, ref, tp1_peak = [], None, 0.0
    if tp_rank == 0:
        peak_reset()
        for _ in range(reps):
            ref, secs = decode(split=False)
            tp1.append(secs)
        tp1_peak = peak()
    barrier()
    tp2, got = [], None
    peak_reset()
    for _ in range(reps):
        barrier()
        got, secs = decode(split=True)
        tp2.append(secs)
    digest = hashlib.sha256(got.numpy().tobytes()).hexdigest()[:16]
    return {
        "tp1_s": tp1,
        "tp2_s": tp2,
        "tp1_peak_gib": tp1_peak,
        "tp2_peak_gib": peak(),
        "equal_to_tp1": bool(torch.equal(got, ref)) if ref is not None else None,
        "digest": digest,
        "frames": list(got.shape),
        "chunks": vae._decode_temporal_chunks(z.shape[2])[1],
    }


def attention_name() -> str:
    from comfy.ldm.modules.attention import optimized_attention

    return getattr(optimized_attention, "__name__", str(optimized_attention))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_DIR", os.path.expanduser("~/ComfyUI")))
    ap.add_argument("--device-dir", help="unpack ComfyUI and wheels staged by scripts/bench/stage.sh (e.g. .device)")
    ap.add_argument("--resolutions", default=None, help="WxH list (default 832x480,1344x768; --tiny: 96x64)")
    ap.add_argument("--frames", type=int, default=None, help="pixel frames (default 124; --tiny: 56)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="CPU + gloo, 2-layer decoder: a smoke test")
    args = ap.parse_args(argv)
    args.resolutions = args.resolutions or ("96x64" if args.tiny else "832x480,1344x768")
    args.frames = args.frames or (56 if args.tiny else 124)
    if args.device_dir:
        args.comfyui = unpack_device(args.device_dir)
    ctx = mp.get_context("spawn")
    queue, port, procs = ctx.Queue(), 29700 + os.getpid() % 200, []
    for r in range(2):
        if not args.tiny:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(r)  # one GPU per rank, as scripts/start-tp2.sh does
        procs.append(ctx.Process(target=rank_main, args=(r, 2, port, args, queue)))
        procs[-1].start()
    results = {}
    while len(results) < 2:
        try:
            r, rows, attn = queue.get(timeout=5)
            results[r] = rows
        except Exception:  # noqa: BLE001 - queue.Empty: check that no rank died
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                print(f"a rank exited with {dead}; see its traceback above", file=sys.stderr)
                for p in procs:
                    p.kill()
                return 2
    for p in procs:
        p.join(60)
    report(results, attn, args)
    return 0 if all(row["equal_to_tp1"] for row in results[0]) and all(a["digest"] == b["digest"] for a, b in zip(*results.values())) else 1


def report(results: dict, attention: str, args) -> None:
    gpu = "cpu (tiny)" if args.tiny else torch.cuda.get_device_name(0) if torch.cuda.is_available() else "?"
    print(
        f"H3 video VAE decode, {args.frames} frames, {'fp32 2-layer' if args.tiny else 'full-size fp16'} random weights, {gpu}, attention {attention}, median of {args.reps}"
    )
    print("| resolution | latent | chunks | TP1 s | TP2 s | speed-up | peak GiB TP1 / TP2 (rank 0) | TP2 == TP1 | ranks equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for a, b in zip(results[0], results[1]):
        t1, t2 = statistics.median(a["tp1_s"]), statistics.median(a["tp2_s"])
        print(
            f"| {a['resolution']} | {a['latent']} | {a['chunks']} | {t1:.3f} | {t2:.3f} | {t1 / t2:.2f}x | "
            f"{a['tp1_peak_gib']:.2f} / {a['tp2_peak_gib']:.2f} | {a['equal_to_tp1']} | {a['digest'] == b['digest']} |"
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vae_decode_bench.json"), "w") as f:
        json.dump({"gpu": gpu, "attention": attention, "frames": args.frames, "ranks": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
