#!/usr/bin/env python3
"""How much of "mux and save" is the content: ComfyUI's own video save (`VideoFromComponents.save_to`, what
SaveVideo runs: H.264 through PyAV, AAC audio) of the same-size clip with three contents: uniform noise (close to
what a random-weight model decodes), smooth moving gradients, and gradients with a fine moving texture.

    python scripts/bench/encode_content.py [--comfyui DIR] [--size 832x480] [--frames 124] [--out DIR]

One line per content on stdout: seconds, MB written. Runs on the CPU (PyAV and x264 need no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from fractions import Fraction

import torch


def contents(t: int, h: int, w: int) -> dict[str, torch.Tensor]:
    yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    smooth = torch.stack(
        [
            torch.stack([torch.sin(6 * xx + 0.1 * i) * 0.5 + 0.5, torch.cos(5 * yy - 0.07 * i) * 0.5 + 0.5, (xx + yy + 0.01 * i) % 1.0], -1)
            for i in range(t)
        ]
    )
    texture = 0.08 * torch.sin(80 * xx + 60 * yy)[None, ..., None]
    return {
        "noise": torch.rand(t, h, w, 3, generator=torch.Generator().manual_seed(0)),
        "smooth": smooth,
        "textured": (smooth + texture).clamp(0, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_DIR", os.path.expanduser("~/ComfyUI")))
    ap.add_argument("--size", default="832x480")
    ap.add_argument("--frames", type=int, default=124)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args(argv)
    sys.path.insert(0, a.comfyui)
    from comfy_api.latest._input_impl.video_types import VideoFromComponents
    from comfy_api.latest._util import VideoComponents

    w, h = map(int, a.size.split("x"))
    audio = {"waveform": torch.zeros(1, 2, int(44100 * a.frames / 24)), "sample_rate": 44100}
    for name, frames in contents(a.frames, h, w).items():
        video = VideoFromComponents(VideoComponents(images=frames, audio=audio, frame_rate=Fraction(24)))
        path = os.path.join(a.out, f"encode_{name}.mp4")
        t0 = time.perf_counter()
        video.save_to(path)
        seconds = time.perf_counter() - t0
        print(json.dumps({"content": name, "size": a.size, "frames": a.frames, "seconds": round(seconds, 2),
                          "mb": round(os.path.getsize(path) / 1e6, 1), "cpus": os.cpu_count()}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
