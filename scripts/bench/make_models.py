#!/usr/bin/env python3
"""The four H3 models of the bundled workflows, with random weights and the released key layouts, under the
file names the bundled workflows load (scripts/make_workflows.py), so a benchmark runs those workflows unchanged.

    python scripts/bench/make_models.py --comfyui DIR --models BASE/models [--tiny]

Full size (the default; on a GPU machine, ~41 GB written):
  diffusion_models/  the int8 ConvRot DiT                  scripts/make_tiny_h3.py --full-size --int8
  text_encoders/     the nvfp4 AWQ Qwen3-VL-32B encoder     scripts/make_tiny_qwen3vl.py --full-size --format nvfp4
  vae/ (video)       ComfyUI's MiniMaxH3VideoVAE, fp16      its own state dict, random weights
  vae/ (audio)       ComfyUI's MiniMaxH3AudioVAE, fp32      its own state dict, random weights
--tiny (CPU): the tiny int8 DiT and tiny nvfp4 encoder of the tests, the small video VAE of the test fixture
h3_small_vae (servers need H3_TEST_SMALL_VAE=1 and H3_TEST_TINY_TE=1 and both fixtures in custom_nodes), and the
audio VAE at its real size. A file that exists is kept (delete it to write it again).
--cut-ahead 2: as each H3 file is written, each rank's cut of it into the rank cache, then its large tensors freed on disk
(punch): the models and two ranks' caches then fit the device's 64 GiB disk (~45 GB instead of ~81).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "scripts"), ROOT, os.path.dirname(os.path.abspath(__file__))]
from make_workflows import AUDIO_VAE, DIT, TEXT_ENCODER, VIDEO_VAE  # noqa: E402

from tp2 import settings  # noqa: E402
from tp2.safetensors_io import DTYPES, fingerprint_windows, read_header  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "comfy", "fixtures")
TINY_ENV = {"H3_TEST_SMALL_VAE": "1", "H3_TEST_TINY_TE": "1"}  # what servers need to build the tiny stand-ins
PAGE = 4096
PUNCH_HOLE_KEEP_SIZE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def fill_random(module, seed: int, device: str = "cpu") -> None:
    """Seeded random weights that keep activations O(1) (ComfyUI's ops leave parameters uninitialised)."""
    import torch

    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            r = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
            if name.endswith("bias"):
                r *= 0.02
            elif p.ndim >= 2 and "register_tokens" not in name:
                r /= p[0].numel() ** 0.5
            else:  # norm weights, layer scales, register tokens
                r = 0.5 + 0.1 * r
            p.copy_(r)


def _write_vae(kind: str, path: str, comfyui: str, tiny: bool) -> None:
    """ComfyUI's own VAE class, random weights, its state dict saved (runs in a child with ComfyUI importable)."""
    import torch
    from safetensors.torch import save_file

    sys.path[:0] = [comfyui, FIXTURES]
    import comfy.cli_args

    comfy.cli_args.args.cpu = tiny
    import h3_small_vae  # with H3_TEST_SMALL_VAE=1 (tiny) it makes ComfyUI build its VAE class small

    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    from comfy.ldm.minimax.audio_vae import MiniMaxH3AudioVAE
    from comfy.ldm.minimax.vae import MiniMaxH3VideoVAE

    cls = MiniMaxH3VideoVAE if kind == "video" else MiniMaxH3AudioVAE
    dtype = torch.float16 if kind == "video" and not tiny else torch.float32
    with torch.device(device):
        vae = cls()
    fill_random(vae, seed=0 if kind == "video" else 1, device=device)
    h3_small_vae.fill_empty_buffers(vae)
    save_file({k: v.to(dtype).contiguous().cpu() for k, v in vae.state_dict().items()}, path)


def rank_cuts(path: str, tp_size: int) -> list[list[str]]:
    """Per rank, the rank cache files (TP2_CACHE_DIR's rule) cut from H3 file `path` at `tp_size`."""
    stem, folder = os.path.splitext(os.path.basename(path))[0], os.path.join(settings.cache_dir(), "rank_cache")
    return [glob.glob(os.path.join(folder, f"{glob.escape(stem)}.*.tp{tp_size}-rank{r}.safetensors")) for r in range(tp_size)]


def punch(path: str, min_bytes: int) -> int:
    """Free on disk (fallocate PUNCH_HOLE | KEEP_SIZE) the data of `path`'s tensors of at least `min_bytes` but the windows
    of tp2.safetensors_io's file fingerprint: the file keeps its size, header and small tensors (the `.comfy_quant`
    markers the pack's planner reads), so the rank cache still knows it as the file its cuts came from. Punched bytes
    read back as zeros: punch only what the rank cache serves (the set-up's test compares the videos). A PATH.punched
    marker records it. Returns the bytes freed."""
    header = read_header(path)
    keep, libc, freed = sorted(fingerprint_windows(header)), ctypes.CDLL("libc.so.6", use_errno=True), 0
    with open(path, "r+b") as f:
        for info in header.tensors.values():
            lo = info.start
            hi = lo + math.prod(info.shape) * DTYPES[info.dtype].itemsize
            if hi - lo < min_bytes:
                continue
            gaps, cur = [], lo  # [lo, hi) without the kept windows
            for a, b in keep:
                if b > cur and a < hi:
                    gaps.append((cur, a))
                    cur = max(cur, b)
            for a, b in gaps + [(cur, hi)]:
                a, b = -(-a // PAGE) * PAGE, b // PAGE * PAGE  # whole pages inside the gap
                if b > a:
                    if libc.fallocate(f.fileno(), PUNCH_HOLE_KEEP_SIZE, ctypes.c_long(a), ctypes.c_long(b - a)) != 0:
                        raise OSError(ctypes.get_errno(), f"cannot punch holes in {path} (its file system may not support it)")
                    freed += b - a
    open(path + ".punched", "w").write(f"{freed}\n")
    return freed


def cut_ahead_and_punch(path: str, tp_size: int, min_bytes: int) -> None:
    """Each rank's cut of H3 file `path` into the rank cache now (`python -m tp2.rank_cache`, as a user would), then the
    file's large tensors freed on disk (punch), so the next model fits beside the cuts."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "tp2.rank_cache", path, "--tp-size", str(tp_size)], check=True, cwd=ROOT)
    freed = punch(path, min_bytes)
    print(f"make_models: {os.path.basename(path)} cut for {tp_size} ranks, {freed / 2**30:.2f} GiB freed on disk, "
          f"{time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip


def write_models(models: str, comfyui: str, tiny: bool = False, cut_ahead: int = 0, min_bytes: int = 1 << 20) -> None:
    """Write what is missing under `models`. cut_ahead N: the DiT's and the text encoder's rank caches for N ranks cut as
    each is written, then their large tensors freed on disk (a file freed before whose cuts are missing is written again)."""
    py, scripts = sys.executable, os.path.join(ROOT, "scripts")
    size = [] if tiny else ["--full-size"]
    makers = {
        f"diffusion_models/{DIT}": lambda p: [py, os.path.join(scripts, "make_tiny_h3.py"), p, "--int8", *size],
        f"text_encoders/{TEXT_ENCODER}": lambda p: [py, os.path.join(scripts, "make_tiny_qwen3vl.py"), p, "--format", "nvfp4", *size],
        f"vae/{VIDEO_VAE}": lambda p: [py, __file__, "--vae", "video", p, "--comfyui", comfyui, *(["--tiny"] if tiny else [])],
        f"vae/{AUDIO_VAE}": lambda p: [py, __file__, "--vae", "audio", p, "--comfyui", comfyui, *(["--tiny"] if tiny else [])],
    }
    env = dict(os.environ, **(TINY_ENV if tiny else {}))
    for rel, make in makers.items():
        path = os.path.join(models, rel)
        h3 = cut_ahead and rel.startswith(("diffusion_models/", "text_encoders/"))
        if h3 and os.path.exists(path + ".punched") and not all(rank_cuts(path, cut_ahead)):
            print(f"make_models: {rel} was freed on disk and a rank's cut of it is missing: writing it again", flush=True)
            os.remove(path)
            os.remove(path + ".punched")
        if written := not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            t0 = time.monotonic()
            subprocess.run(make(path + ".part"), check=True, env=env, cwd=comfyui)
            os.replace(path + ".part", path)
            print(f"make_models: {rel} {os.path.getsize(path) / 2**30:.2f} GiB in {time.monotonic() - t0:.0f} s", flush=True)
        if h3 and (written or not os.path.exists(path + ".punched")):
            cut_ahead_and_punch(path, cut_ahead, min_bytes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", required=True, help="a ComfyUI checkout with MiniMax-H3 (its VAE classes are used)")
    ap.add_argument("--models", help="a ComfyUI models/ folder to fill")
    ap.add_argument("--tiny", action="store_true", help="the CPU test stand-ins instead of the full-size models")
    ap.add_argument("--cut-ahead", type=int, default=0, metavar="TP_SIZE", help="cut the H3 files for TP_SIZE ranks, then punch them")
    ap.add_argument("--punch-min-bytes", type=int, default=1 << 20, help=argparse.SUPPRESS)  # the tests' tiny files
    ap.add_argument("--vae", nargs=2, metavar=("video|audio", "PATH"), help=argparse.SUPPRESS)  # the child's job
    a = ap.parse_args(argv)
    if a.vae:
        _write_vae(a.vae[0], a.vae[1], os.path.abspath(a.comfyui), a.tiny)
        return 0
    if not a.models:
        ap.error("--models is required")
    write_models(os.path.abspath(a.models), os.path.abspath(a.comfyui), a.tiny, a.cut_ahead, a.punch_min_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
