"""How much GPU memory one rank needs to sample an H3 video, and the longest video that fits: the advice logged at
every sampler, `start-tp2.sh check`, and `python -m tp2.capacity --gpu-mem 22 [--tp-size 2] [--dtype fp32] [--fast]`
(`--gpu-mem 24,12`: one per rank, the longest that fits on every rank at --split 2:1 and at the even split).

A rank holds a fraction f of the split layers (1/tp at the even split). Its activations at the sampler's peak are
tokens x (SHARED + SPLIT x f) per token, x 1.76 in fp32 compute, x FAST_SCALE with sequence parallelism (--fast).
Resident (--highvram): peak = weights x f + FIXED_GIB[tp] + activations, least squares on nvidia-smi peaks (MEASURED).
Streamed (dynamic VRAM): peak = CONTEXT_GIB + the STREAMED_BLOCKS in flight + activations x POOL_OVER_LIVE[allocator]
(--lean-memory: torch's native allocator; dynamic VRAM frees weights only for cudaMalloc/cudaMallocAsync calls).
"""

from __future__ import annotations

import argparse
import sys

from .errors import PlanError
from .split import Shares, even, is_even, named, parse_split, reduced

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
CONTEXT_GIB = 1.2  # outside torch's pool: CUDA context, cuBLAS workspace, dynamic VRAM's buffers (30.8 - 29.6 measured)
# part of every prediction already held when the check at the sampler asks what is free (the CUDA context)
HELD_AT_THE_SAMPLER_GIB = 0.7
# activations in fp32 compute over bf16 (the int8 weights stay): 1.75-1.77x measured, weights streamed and resident
ACTIVATIONS_OVER_BF16 = {"bf16": 1.0, "fp32": 1.76}
# --fast (sequence parallelism, the MLP in row chunks): one TP2 rank's live GiB, streamed, 2026-12-02
MEASURED_FAST = (1920, 1088, 362, 2, 14.14)
# torch's pool over its live bytes, per allocator (native: the rank of a pair that met the memory limit)
POOL_OVER_LIVE = {"cudaMallocAsync": 1.39, "expandable": 1.31, "native": 1.24}
LEAN_ALLOCATOR = "native"  # the launcher's --lean-memory: ComfyUI's --disable-cuda-malloc
RESOLUTIONS = ((832, 480), (1344, 768), (1600, 896), (1920, 1088))
MODES = (("resident", False, ASYNC), ("streamed", True, ASYNC), ("--lean-memory", True, LEAN_ALLOCATOR))
SHARES_OFF_BY = 0.02  # --split's default: the smallest shares whose fractions are this close to the memory's


def frames_on_grid(frames: int) -> int:
    """H3's lengths: 17k + 5 frames (ComfyUI rounds up to the grid)."""
    frames = max(5, frames)
    return frames + (5 - frames) % 17


def latent_frames(frames: int) -> int:
    """The video latent's frames for `frames` pixel frames (ComfyUI's H3 nodes: 5 -> 2, then 5 per 17)."""
    return (frames_on_grid(frames) - 5) // 17 * 5 + 2


def pixel_frames(latent_t: int) -> int:
    """The length on the grid whose video latent has `latent_t` frames (the inverse of latent_frames)."""
    return 5 if latent_t <= 2 else (latent_t - 2) // 5 * 17 + 5


def tokens(width: int, height: int, frames: int, text_tokens: int = TEXT_TOKENS) -> int:
    """Rows of the packed sequence: video (latent frames x H/32 x W/32), stereo audio at 40 Hz, text."""
    frames = frames_on_grid(frames)
    audio_t = round(frames / 24 * 40)
    return latent_frames(frames) * (height // 32) * (width // 32) + 2 * audio_t + text_tokens


def allocator_of(backend: str, alloc_conf: str) -> str:
    """torch's CUDA allocator as POOL_OVER_LIVE names it, from torch.cuda.get_allocator_backend() and
    PYTORCH_CUDA_ALLOC_CONF (native: the launcher's --lean-memory)."""
    if backend == ASYNC:
        return backend
    return "expandable" if "expandable_segments:true" in alloc_conf.replace(" ", "").lower() else "native"


def split_part(whole: float, tp_size: int, fraction: float | None = None) -> float:
    """A rank's part of a split quantity: `whole` x `fraction`; None (or 1/tp_size) divides by tp_size (bit for bit)."""
    return whole / tp_size if fraction is None or fraction == 1 / tp_size else whole * fraction


def activations_gib(
    n_tokens: int, tp_size: int, hidden: int = H3_HIDDEN, fraction: float | None = None, dtype: str = "bf16", fast: bool = False
) -> float:
    """One rank's activations at the sampler's peak, scaled with the model's width (the released H3 is 5376 wide)."""
    per_token = (SHARED_PER_TOKEN_GIB + split_part(SPLIT_PER_TOKEN_GIB, tp_size, fraction)) * hidden / H3_HIDDEN
    return n_tokens * per_token * ACTIVATIONS_OVER_BF16[dtype] * (FAST_SCALE if fast else 1.0)


_w, _h, _f, _tp, _live = MEASURED_FAST
FAST_SCALE = _live / activations_gib(tokens(_w, _h, _f), _tp)  # measured over the activations without it


def predict_peak_gib(n_tokens: int, tp_size: int, rank_weights_gib: float | None = None, hidden: int = H3_HIDDEN, streamed: bool = False,
                     allocator: str = ASYNC, fraction: float | None = None, dtype: str = "bf16", fast: bool = False) -> float:  # fmt: skip
    """One rank's peak: its weights (the released DiT's share unless given), the fixed buffers and the activations.
    `streamed`: under dynamic VRAM (only the blocks in flight resident), torch's pool as `allocator` holds it.
    `fraction`: the rank's part of the split layers (None: 1/tp_size); `fast`: sequence parallelism on."""
    weights = split_part(WEIGHTS_GIB, tp_size, fraction) if rank_weights_gib is None else rank_weights_gib
    activations = activations_gib(n_tokens, tp_size, hidden, fraction, dtype, fast)
    if streamed:
        pool = activations * POOL_OVER_LIVE.get(allocator, POOL_OVER_LIVE[ASYNC])
        return CONTEXT_GIB + weights * STREAMED_BLOCKS / BLOCKS + pool
    return weights + FIXED_GIB.get(tp_size, FIXED_GIB[2]) + activations


def longest_frames(width: int, height: int, gpu_gib: float, tp_size: int, up_to: int = 3600, **how) -> int | None:
    """The longest length on the 17k+5 grid whose predicted peak is at most `gpu_gib` (None: not even 5 frames);
    `how`: predict_peak_gib's options (streamed, allocator, fraction, dtype, fast)."""
    best = None
    for frames in range(5, up_to + 1, 17):
        if predict_peak_gib(tokens(width, height, frames), tp_size, **how) > gpu_gib:
            break
        best = frames
    return best


def advice(width: int, height: int, frames: int, tp_size: int, available_gib: float, streamed: bool = False, **how) -> str:
    """What would fit instead on this rank (`how`: allocator, fraction, dtype, fast as predict_peak_gib takes them): the
    longest length at this resolution, the smallest tp_size for this length (the rank's share relative to an even one
    kept), and (where it is what stops the prompt) the leaner allocator."""
    fit = longest_frames(width, height, available_gib, tp_size, streamed=streamed, **how)
    parts = [f"at {width}x{height} up to {fit} frames fit" if fit else f"not even 5 frames fit at {width}x{height}"]
    n, fraction = tokens(width, height, frames), how.pop("fraction", None)
    lean = predict_peak_gib(n, tp_size, fraction=fraction, **{**how, "streamed": True, "allocator": LEAN_ALLOCATOR})
    if streamed and how.get("allocator", ASYNC) == ASYNC and lean <= available_gib:
        parts.append(f"or start the ranks with --lean-memory (~{lean:.1f} GiB per rank)")
    for bigger in (2, 4):  # the sizes the int8 release splits into (python -m tp2.inspect)
        need = predict_peak_gib(n, bigger, streamed=streamed, fraction=None if fraction is None else fraction * tp_size / bigger, **how)
        if bigger > tp_size and need <= available_gib:
            parts.append(f"or use tp_size {bigger} (~{need:.1f} GiB per rank)")
            break
    return ", ".join(parts)


def memory_shares(gpus: list[float]) -> Shares:
    """--split's default: shares in proportion to each GPU's memory, the smallest whole numbers within SHARES_OFF_BY
    of it (24,12 -> 2:1, 24,16 -> 3:2, equal GPUs -> even)."""
    want = [g / sum(gpus) for g in gpus]
    for k in range(1, 9):
        shares = tuple(round(g / min(gpus) * k) for g in gpus)
        if max(abs(s / sum(shares) - w) for s, w in zip(shares, want)) <= SHARES_OFF_BY:
            break
    return reduced(shares)


def longest_on_every_rank(
    width: int, height: int, gpus: list[float], shares: Shares, streamed: bool = False, **how
) -> tuple[int | None, int]:
    """The longest length that fits on every rank (rank r: gpus[r] GiB, shares[r] / sum(shares) of the split layers)
    and the rank that limits it (the lowest of those that tie); `how`: allocator, dtype, fast."""
    fits = [longest_frames(width, height, g, len(shares), streamed=streamed, fraction=s / sum(shares), **how) for g, s in zip(gpus, shares)]
    rank = min(range(len(fits)), key=lambda r: fits[r] or 0)
    return fits[rank], rank


def table(gpus: list[float], shares: Shares, dtype: str = "bf16", fast: bool = False) -> str:
    """Per resolution and mode, the longest length that fits on every rank at `shares`: on equal GPUs at the even split
    with its predicted peak, else with the rank that limits it, beside what the even split allows on the same GPUs."""
    alike = len(set(gpus)) == 1 and is_even(shares)
    compared = (shares,) if is_even(shares) else (shares, even(len(gpus)))
    on = f"{gpus[0]:g} GiB at tp_size {len(gpus)}" if alike else f"GPUs with {', '.join(f'{g:g}' for g in gpus)} GiB (rank 0 first)"
    cell = (
        "(seconds at 24 fps, predicted peak GiB)" if alike else f"(seconds at 24 fps) and the rank that limits it at split {named(shares)}"
    )
    lines = [f"longest H3 video per rank on {on}, {dtype} compute{', --fast' if fast else ''}: frames {cell}"
             f"{', beside the even split' if len(compared) > 1 else ''}; resident: --highvram, streamed: ComfyUI's dynamic VRAM "
             "(its default on NVIDIA), --lean-memory: streamed on torch's native allocator", "",
             "| resolution | " + " | ".join(f"{m}{'' if alike else ' ' + named(s)}" for m, _, _ in MODES for s in compared) + " |",
             "|---|" + "---|" * len(MODES) * len(compared)]  # fmt: skip
    for w, h in RESOLUTIONS:
        cells = []
        for (_, streamed, allocator), s in ((mode, s) for mode in MODES for s in compared):
            how = dict(streamed=streamed, allocator=allocator, dtype=dtype, fast=fast)
            f, r = longest_on_every_rank(w, h, gpus, s, **how)
            said = f", {predict_peak_gib(tokens(w, h, f), len(gpus), **how):.1f}" if alike and f else ""
            cells.append((f"{f} ({f / 24:.1f} s{said})" if f else "none") + ("" if alike or s != shares else f", rank {r}"))
        lines.append(f"| {w}x{h} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gpu_list(text: str) -> list[float]:
    """--gpu-mem: GiB per GPU, one value or one per rank joined by ','."""
    try:
        gpus = [float(v) for v in text.split(",")]
    except ValueError:
        gpus = []
    if not gpus or not all(0 < g < float("inf") for g in gpus):
        raise argparse.ArgumentTypeError(
            f"'{text}' is not GiB per GPU: one positive number (every GPU) or one per rank joined by ',', e.g. 24,12"
        )
    return gpus


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tp2.capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-mem", type=gpu_list, required=True,
                    help="GiB of memory per GPU: one value for every GPU (e.g. 22 for a 2080 Ti 22 GB), "
                    "or one per rank, rank 0 first (24,12)")  # fmt: skip
    ap.add_argument("--tp-size", type=int, help="ranks (default: the number of --gpu-mem values, or 2 for one value)")
    ap.add_argument("--split", help="each rank's share of the split layers, e.g. 3:2 (default: in proportion to --gpu-mem, "
                    "as small whole numbers: 24,12 -> 2:1; one value: even)")  # fmt: skip
    ap.add_argument("--dtype", choices=tuple(ACTIVATIONS_OVER_BF16), default="bf16",
                    help="the DiT's compute dtype (fp32: what the pack runs below compute capability 8.0, e.g. a 2080 Ti)")  # fmt: skip
    ap.add_argument("--fast", action="store_true", help="the launcher's --fast (sequence parallelism): fewer activations")
    a = ap.parse_args(argv)
    n = len(a.gpu_mem)
    tp_size = a.tp_size if a.tp_size is not None else (n if n > 1 else 2)
    if tp_size < 1 or n not in (1, tp_size):
        ap.error(f"--gpu-mem names {n} GPUs for tp_size {tp_size}: give one value (every GPU that size) or one per rank")
    gpus = a.gpu_mem * tp_size if n == 1 else a.gpu_mem
    try:
        shares = parse_split(a.split, tp_size) if a.split else memory_shares(gpus)
    except PlanError as e:
        ap.error(f"{e} (Left out here, it follows --gpu-mem: {named(memory_shares(gpus))}.)")
    print(table(gpus, shares, a.dtype, a.fast))
    return 0


if __name__ == "__main__":
    sys.exit(main())
