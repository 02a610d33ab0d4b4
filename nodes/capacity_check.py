"""The capacity advice at the sampler: what tp2/capacity.py predicts this rank needs, logged before the ranks meet,
and added to an out-of-memory error if one comes (tp2.watch.with_advice).

What is available is the device's free memory plus what this process already holds (its cached blocks, the weights
dynamic VRAM can evict), less ComfyUI's --reserve-vram. It never refuses a prompt: its constants were fitted on H200s
from a few measured lengths, and a real out-of-memory already stops every rank with the reason. On a CPU it advises nothing.
"""

from __future__ import annotations

import contextlib
import math

import comfy.memory_management
import comfy.model_management as mm
import comfy_aimdo.model_vbar
import torch

from ..tp2 import capacity, settings
from ..tp2.plan import Plan
from ..tp2.safetensors_io import DTYPES
from .state import STATE, log


def capacity_advice(plan: Plan, latent_shapes, device: torch.device, patcher) -> str | None:
    """Log the prediction for this prompt; return what would fit when it predicts this one does not, else None."""
    available = _available_gib(device)
    video = next((tuple(s) for s in latent_shapes or () if len(s) == 5), None)  # [B, C, T, H/16, W/16]
    if available is None or video is None:
        return None
    width, height, frames = video[4] * 16, video[3] * 16, capacity.pixel_frames(video[2])
    rows = capacity.tokens(width, height, frames)
    fraction = plan.shares[STATE.env.tp_rank] / sum(plan.shares)  # this rank's part of the split layers
    shard = sum(math.prod(ts.local_shape(STATE.env.tp_rank)) * DTYPES[ts.dtype].itemsize for ts in plan.tensors.values()) / capacity.GIB
    # ComfyUI's dynamic VRAM (ModelPatcherDynamic) pages the weights in block by block; --highvram keeps them resident
    streams = bool(patcher.is_dynamic() and mm.vram_state != mm.VRAMState.HIGH_VRAM)
    allocator = capacity.allocator_of(torch.cuda.get_allocator_backend(), settings.torch_allocator_conf())
    dtype = "fp32" if patcher.model.get_dtype_inference() == torch.float32 else "bf16"  # activations: 4 or 2 bytes (fp16 as bf16)
    how = dict(fraction=fraction, dtype=dtype, fast=settings.value("TP2_SEQUENCE_PARALLEL"))
    resident = capacity.predict_peak_gib(rows, plan.tp_size, shard, plan.hidden, **how)
    streamed = capacity.predict_peak_gib(rows, plan.tp_size, shard, plan.hidden, streamed=True, allocator=allocator, **how)
    need = streamed if streams else resident
    fits = need - capacity.HELD_AT_THE_SAMPLER_GIB <= available  # the CUDA context is in the need and already held
    advice = None
    if not fits:
        budget = available + capacity.HELD_AT_THE_SAMPLER_GIB  # what tp2.capacity's table calls the card's memory
        what = capacity.advice(width, height, frames, plan.tp_size, budget, streamed=streams, allocator=allocator, **how)
        mode = "with the weights streamed" if streams else "with the weights resident"
        advice = (
            f"{width}x{height}x{frames} was predicted to need ~{need:.1f} GiB per rank at tp_size {plan.tp_size} {mode} "
            f"in {dtype} compute, {available:.1f} GiB more was available: {what} (tp2/capacity.py)"
        )
    log.info(
        "%s capacity: %dx%dx%d, %d rows, %s compute: predicted peak ~%.1f GiB with the weights resident, ~%.1f GiB streamed (%s); "
        "%.1f GiB available; weights %s; %s",
        STATE.tag, width, height, frames, rows, dtype, resident, streamed, allocator, available,
        "may stream (dynamic VRAM)" if streams else "resident (no dynamic VRAM)",
        "fits" if fits else f"may not fit: {advice}",
    )  # fmt: skip
    return advice


@contextlib.contextmanager
def sampling_peak(device: torch.device):
    """Log the peak of this process's live tensors and of torch's cache over the block (what tp2/capacity.py's
    streamed model is calibrated against)."""
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
    finally:
        if on_gpu:
            log.info(
                "%s sampling peak: %.2f GiB of live tensors, %.2f GiB reserved by torch's allocator", STATE.tag,
                torch.cuda.max_memory_allocated(device) / capacity.GIB, torch.cuda.max_memory_reserved(device) / capacity.GIB,
            )  # fmt: skip


def _available_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    evictable = comfy_aimdo.model_vbar.vbars_analyze(device.index) if comfy.memory_management.aimdo_enabled else 0
    return (free + torch.cuda.memory_reserved(device) + evictable - mm.extra_reserved_memory()) / capacity.GIB
