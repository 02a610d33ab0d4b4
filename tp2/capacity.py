"""How much GPU memory one rank needs to sample an H3 video, and the longest video that fits: a model calibrated on
measurements, so a prompt that cannot fit is refused before sampling instead of failing mid-step.

    tokens(width, height, frames)                 the packed sequence length the DiT samples
    predict_peak_gib(tokens, tp_size)             one rank's peak: its weights + fixed buffers + bytes per token
    predict_peak_gib(..., streamed=True)          the same with the weights streamed block by block (ComfyUI's
                                                  dynamic VRAM): only the blocks in flight are resident
    longest_frames(width, height, gpu_gib, tp)    the longest length on H3's 17k+5 grid under `gpu_gib`
    python -m tp2.capacity --gpu-mem 22 --tp-size 2    the table of longest lengths per resolution

The model: peak = weights / tp + fixed + tokens x (shared + split / tp) GiB. Streamed, the weights term is the
blocks ComfyUI holds at once (STREAMED_BLOCKS of BLOCKS: the one computing and the next, prefetched). Calibrated (least squares) on the peaks
measured with all weights resident (nvidia-smi, ComfyUI --highvram, int8 ConvRot DiT; docs/PERFORMANCE.md): stock
ComfyUI on one H200 at 832x480 and 1344x768 x124, and TP2 with --fast on 2x H200 at 832x480, 1344x768, 1600x896
and 1920x1088 x124, 1920x1088 x158 and x175. The fit is within 0.6% of every
point; the one-GPU points are stock ComfyUI (without the pack's savings) and the two-GPU ones the pack with --fast,
so the split between shared and split bytes is approximate, and tp sizes other than 1 and 2 follow the model's form
unmeasured. ComfyUI can
offload weights where memory is short (lowvram); the prediction is for weights resident, so it errs towards more.
Imports nothing from `comfy`.
"""

from __future__ import annotations

import argparse
import sys

TEXT_TOKENS = 256  # the bundled workflows' conditioning (ComfyUI's Qwen3-VL prompts: a few hundred tokens)
WEIGHTS_GIB = 18.9  # the int8 ConvRot DiT, whole (20.3 GB)
H3_HIDDEN = 5376
BLOCKS = 50  # H3's DiT blocks, nearly all of its weights
STREAMED_BLOCKS = 2  # streamed: the block computing and the next one, copied in beside it (comfy.model_prefetch)
# calibrated constants (see the module docstring and tests/unit/test_capacity.py for the fit's residuals)
FIXED_GIB = {1: 0.72, 2: 1.96}  # CUDA context, ComfyUI's and the pack's fixed buffers, per tp (more with the pack)
SHARED_PER_TOKEN_GIB = 5.61e-5  # activations every rank holds whole (gathered inputs, the stream at the ends)
SPLIT_PER_TOKEN_GIB = 7.51e-5  # activations split over the ranks (heads: q/k/v and attention, the FFN slice)
# (width, height, frames, tp_size, measured peak GiB per rank)
MEASURED = (
    (832, 480, 124, 1, 21.6), (1344, 768, 124, 1, 24.6),
    (832, 480, 124, 2, 12.9), (1344, 768, 124, 2, 14.9), (1600, 896, 124, 2, 16.3),
    (1920, 1088, 124, 2, 18.5), (1920, 1088, 158, 2, 20.5), (1920, 1088, 175, 2, 21.45),
)  # fmt: skip
RESOLUTIONS = ((832, 480), (1344, 768), (1600, 896), (1920, 1088))


def frames_on_grid(frames: int) -> int:
    """H3's lengths: 17k + 5 frames (ComfyUI rounds up to the grid)."""
    frames = max(5, frames)
    return frames + (5 - frames) % 17


def latent_frames(frames: int) -> int:
    """The video latent's frames for `frames` pixel frames (ComfyUI's H3 nodes: 5 -> 2, then 5 per 17)."""
    frames = frames_on_grid(frames)
    return 2 if frames <= 5 else ((frames - 5) // 17) * 5 + 2


def pixel_frames(latent_t: int) -> int:
    """The length on the grid whose video latent has `latent_t` frames (the inverse of latent_frames)."""
    return 5 if latent_t <= 2 else (latent_t - 2) // 5 * 17 + 5


def tokens(width: int, height: int, frames: int, text_tokens: int = TEXT_TOKENS) -> int:
    """Rows of the packed sequence: video (latent frames x H/32 x W/32), stereo audio at 40 Hz, text."""
    frames = frames_on_grid(frames)
    latent_t = latent_frames(frames)
    audio_t = round(frames / 24 * 40)
    return latent_t * (height // 32) * (width // 32) + 2 * audio_t + text_tokens


def predict_peak_gib(
    n_tokens: int, tp_size: int, rank_weights_gib: float | None = None, hidden: int = H3_HIDDEN, streamed: bool = False
) -> float:
    """One rank's peak: its weights (the released DiT's share unless given; `streamed`: only the blocks in flight),
    the fixed buffers, and the activations per token, which scale with the model's width (`hidden`; the released
    H3 is 5376 wide)."""
    weights = WEIGHTS_GIB / tp_size if rank_weights_gib is None else rank_weights_gib
    if streamed:
        weights *= STREAMED_BLOCKS / BLOCKS
    per_token = (SHARED_PER_TOKEN_GIB + SPLIT_PER_TOKEN_GIB / tp_size) * hidden / H3_HIDDEN
    return weights + FIXED_GIB.get(tp_size, FIXED_GIB[2]) + n_tokens * per_token


def longest_frames(width: int, height: int, gpu_gib: float, tp_size: int, up_to: int = 3600, streamed: bool = False) -> int | None:
    """The longest length on the 17k+5 grid whose predicted peak is at most `gpu_gib` (None: not even 5 frames)."""
    best = None
    for frames in range(5, up_to + 1, 17):
        if predict_peak_gib(tokens(width, height, frames), tp_size, streamed=streamed) > gpu_gib:
            break
        best = frames
    return best


def advice(width: int, height: int, frames: int, tp_size: int, available_gib: float, streamed: bool = False) -> str:
    """What would fit instead: the longest length at this resolution, and the smallest tp_size for this length."""
    fit = longest_frames(width, height, available_gib, tp_size, streamed=streamed)
    parts = [f"at {width}x{height} up to {fit} frames fit" if fit else f"not even 5 frames fit at {width}x{height}"]
    n = tokens(width, height, frames)
    for bigger in (2, 4, 8):
        need = predict_peak_gib(n, bigger, streamed=streamed)
        if bigger > tp_size and need <= available_gib:
            parts.append(f"or use tp_size {bigger} (~{need:.1f} GiB per rank)")
            break
    return ", ".join(parts)


def table(gpu_gib: float, tp_size: int) -> str:
    lines = [f"longest H3 video per rank on {gpu_gib:g} GiB at tp_size {tp_size} (24 fps), with the DiT's weights resident "
             "(--highvram) and streamed block by block (ComfyUI's dynamic VRAM, its default on NVIDIA):", "",
             "| resolution | resident: frames | seconds | peak GiB | streamed: frames | seconds | peak GiB |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for w, h in RESOLUTIONS:
        cells = []
        for streamed in (False, True):
            f = longest_frames(w, h, gpu_gib, tp_size, streamed=streamed)
            peak = predict_peak_gib(tokens(w, h, f), tp_size, streamed=streamed) if f else None
            cells += [str(f), f"{f / 24:.1f}", f"{peak:.1f}"] if f else ["none", "-", "-"]
        lines.append(f"| {w}x{h} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tp2.capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-mem", type=float, required=True, help="GiB of memory per GPU (e.g. 22 for a 2080 Ti 22 GB)")
    ap.add_argument("--tp-size", type=int, default=2)
    a = ap.parse_args(argv)
    print(table(a.gpu_mem, a.tp_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
