"""How much GPU memory one rank needs to sample an H3 video, and the longest video that fits: a model calibrated on
measurements (MEASURED, MEASURED_STREAMED), for the advice logged at every sampler.

`python -m tp2.capacity --gpu-mem 22 --tp-size 2` prints the longest lengths per resolution (imports no `comfy`).

Resident (--highvram): peak = weights / tp + FIXED_GIB + tokens x (SHARED + SPLIT / tp), least squares on peaks
measured with all weights resident (nvidia-smi, int8 ConvRot DiT; docs/PERFORMANCE.md); its TP2 points predate the
chunked MLP, so at TP2 it errs towards more. Streamed (dynamic VRAM): peak = CONTEXT_GIB + STREAMED_BLOCKS / BLOCKS of
the weights (the block computing and the next) + torch's pool = live x POOL_OVER_LIVE[allocator]; live bytes per row
follow the activation accounting (SHARED_ROW_BYTES held whole, SPLIT_ROW_BYTES / tp at the attention's peak), scaled to
one measured TP2 length (others unmeasured). --lean-memory is the native allocator without expandable segments
(dynamic VRAM frees weights only for cudaMalloc/cudaMallocAsync calls).
"""

from __future__ import annotations

import argparse
import sys

TEXT_TOKENS = 256  # the bundled workflows' conditioning (ComfyUI's Qwen3-VL prompts: a few hundred tokens)
WEIGHTS_GIB = 18.9  # the int8 ConvRot DiT, whole (20.3 GB)
H3_HIDDEN = 5376
BLOCKS = 50  # H3's DiT blocks, nearly all of its weights
STREAMED_BLOCKS = 2  # streamed: the block computing and the next one, copied in beside it (comfy.model_prefetch)
GIB = 1 << 30
ASYNC = "cudaMallocAsync"  # ComfyUI's default CUDA allocator
# resident: calibrated constants (see the module docstring and tests/unit/test_capacity.py for the fit's residuals)
FIXED_GIB = {1: 0.72, 2: 1.96}  # CUDA context, ComfyUI's and the pack's fixed buffers, per tp (more with the pack)
SHARED_PER_TOKEN_GIB = 5.61e-5  # activations every rank holds whole (gathered inputs, the stream at the ends)
SPLIT_PER_TOKEN_GIB = 7.51e-5  # activations split over the ranks (heads: q/k/v and attention, the FFN slice)
# (width, height, frames, tp_size, measured peak GiB per rank)
MEASURED = (
    (832, 480, 124, 1, 21.6), (1344, 768, 124, 1, 24.6),
    (832, 480, 124, 2, 12.9), (1344, 768, 124, 2, 14.9), (1600, 896, 124, 2, 16.3),
    (1920, 1088, 124, 2, 18.5), (1920, 1088, 158, 2, 20.5), (1920, 1088, 175, 2, 21.45),
)  # fmt: skip
# streamed: the accounting's bytes per sequence row at the released width, and its scale to the measured live peak
SHARED_ROW_BYTES = 21_504  # the video embedding and the whole stream ComfyUI's forward holds outside the blocks
SPLIT_ROW_BYTES = 75_264  # at the attention's peak, divided by tp: this rank's stream rows, qkv, int8 q/k/v
CONTEXT_GIB = 1.2  # outside torch's pool: CUDA context, cuBLAS workspace, dynamic VRAM's buffers (30.8 - 29.6 measured)
# part of every prediction already held when the check at the sampler asks what is free (the CUDA context): on a
# real 22 GiB limit, free + pooled + evictable came to 21.3 GiB there (measured, docs/PERFORMANCE.md)
HELD_AT_THE_SAMPLER_GIB = 0.7
# 20.06 / 14.42, 18.52 / 14.14 and 17.48 / 14.12 GiB measured; native: the rank of the pair that met the limit (the
# other, with room, held 1.55x: the native allocator keeps what it got and gives it back on an out-of-memory)
POOL_OVER_LIVE = {"cudaMallocAsync": 1.39, "expandable": 1.31, "native": 1.24}
# (width, height, frames, tp_size, allocator, live GiB, pooled GiB) per rank, measured (one GPU, real 2 x 22 GiB)
MEASURED_STREAMED = ((1920, 1088, 362, 2, "expandable", 14.14, 18.52), (1920, 1088, 362, 2, "native", 14.12, 17.48))
LEAN_ALLOCATOR = "native"  # the launcher's --lean-memory: ComfyUI's --disable-cuda-malloc
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


_w, _h, _f, _tp, _, _live, _ = MEASURED_STREAMED[0]
LIVE_SCALE = _live / (tokens(_w, _h, _f) * (SHARED_ROW_BYTES + SPLIT_ROW_BYTES / _tp) / GIB)  # measured / accounted


def allocator_of(backend: str, alloc_conf: str) -> str:
    """torch's CUDA allocator as POOL_OVER_LIVE names it, from torch.cuda.get_allocator_backend() and
    PYTORCH_CUDA_ALLOC_CONF: ComfyUI's default cudaMallocAsync, the native one (the launcher's --lean-memory), or the
    native one with expandable segments."""
    if backend == ASYNC:
        return backend
    return "expandable" if "expandable_segments:true" in alloc_conf.replace(" ", "").lower() else "native"


def live_gib(n_tokens: int, tp_size: int, hidden: int = H3_HIDDEN) -> float:
    """One rank's live tensors at the sampler's peak: the accounting's bytes per row, scaled to the measured length."""
    row_bytes = (SHARED_ROW_BYTES + SPLIT_ROW_BYTES / tp_size) * hidden / H3_HIDDEN
    return LIVE_SCALE * n_tokens * row_bytes / GIB


def predict_peak_gib(
    n_tokens: int,
    tp_size: int,
    rank_weights_gib: float | None = None,
    hidden: int = H3_HIDDEN,
    streamed: bool = False,
    allocator: str = ASYNC,
) -> float:
    """One rank's peak: its weights (the released DiT's share unless given), the fixed buffers and the activations,
    which scale with the model's width (`hidden`; the released H3 is 5376 wide). `streamed`: the least it runs with
    under dynamic VRAM (only the blocks in flight resident), with torch's pool as `allocator` holds it."""
    weights = WEIGHTS_GIB / tp_size if rank_weights_gib is None else rank_weights_gib
    if streamed:
        pool = live_gib(n_tokens, tp_size, hidden) * POOL_OVER_LIVE.get(allocator, POOL_OVER_LIVE[ASYNC])
        return CONTEXT_GIB + weights * STREAMED_BLOCKS / BLOCKS + pool
    per_token = (SHARED_PER_TOKEN_GIB + SPLIT_PER_TOKEN_GIB / tp_size) * hidden / H3_HIDDEN
    return weights + FIXED_GIB.get(tp_size, FIXED_GIB[2]) + n_tokens * per_token


def longest_frames(
    width: int, height: int, gpu_gib: float, tp_size: int, up_to: int = 3600, streamed: bool = False, allocator: str = ASYNC
) -> int | None:
    """The longest length on the 17k+5 grid whose predicted peak is at most `gpu_gib` (None: not even 5 frames)."""
    best = None
    for frames in range(5, up_to + 1, 17):
        if predict_peak_gib(tokens(width, height, frames), tp_size, streamed=streamed, allocator=allocator) > gpu_gib:
            break
        best = frames
    return best


def advice(width: int, height: int, frames: int, tp_size: int, available_gib: float, streamed: bool = False, allocator: str = ASYNC) -> str:
    """What would fit instead: the longest length at this resolution, the smallest tp_size for this length, and (where
    it is what stops the prompt) the leaner allocator."""
    how = dict(streamed=streamed, allocator=allocator)
    fit = longest_frames(width, height, available_gib, tp_size, **how)
    parts = [f"at {width}x{height} up to {fit} frames fit" if fit else f"not even 5 frames fit at {width}x{height}"]
    n = tokens(width, height, frames)
    if streamed and allocator == ASYNC and (lean := predict_peak_gib(n, tp_size, streamed=True, allocator=LEAN_ALLOCATOR)) <= available_gib:
        parts.append(f"or start the ranks with --lean-memory (~{lean:.1f} GiB per rank)")
    for bigger in (2, 4):  # the sizes the int8 release splits into (python -m tp2.inspect)
        need = predict_peak_gib(n, bigger, **how)
        if bigger > tp_size and need <= available_gib:
            parts.append(f"or use tp_size {bigger} (~{need:.1f} GiB per rank)")
            break
    return ", ".join(parts)


def table(gpu_gib: float, tp_size: int) -> str:
    modes = (("resident (--highvram)", False, ASYNC), ("streamed (dynamic VRAM)", True, ASYNC),
             ("streamed, --lean-memory", True, LEAN_ALLOCATOR))  # fmt: skip
    lines = [f"longest H3 video per rank on {gpu_gib:g} GiB at tp_size {tp_size} (frames, seconds at 24 fps, predicted peak GiB): "
             "the DiT's weights resident, streamed block by block by ComfyUI's dynamic VRAM (its default on NVIDIA), and "
             "streamed with the launcher's --lean-memory (torch's native allocator)", "",
             "| resolution | " + " | ".join(m for m, _, _ in modes) + " |", "|---|" + "---|" * len(modes)]  # fmt: skip
    for w, h in RESOLUTIONS:
        cells = []
        for _, streamed, allocator in modes:
            f = longest_frames(w, h, gpu_gib, tp_size, streamed=streamed, allocator=allocator)
            peak = predict_peak_gib(tokens(w, h, f), tp_size, streamed=streamed, allocator=allocator) if f else 0.0
            cells.append(f"{f} ({f / 24:.1f} s, {peak:.1f})" if f else "none")
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
