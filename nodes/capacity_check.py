"""The capacity check at the sampler: a prompt this rank cannot fit in GPU memory is refused before the ranks meet.

    check_capacity(plan, latent_shapes, device)   raises CapacityError with the numbers and what would fit

The need is tp2/capacity.py's prediction for this rank (its shard's weights, the sequence the latent makes, the
model's width); what is available is the device's free memory plus what this process already holds (its cached
blocks, the models ComfyUI can move out). Off with TP2_CAPACITY_CHECK=0; on a CPU it runs only when a test sets
TP2_TEST_AVAILABLE_GIB.
"""

from __future__ import annotations

import math

import torch

from ..tp2 import capacity, settings
from ..tp2.errors import CapacityError
from ..tp2.plan import Plan
from ..tp2.safetensors_io import DTYPES
from .state import STATE, log

GIB = 1 << 30


def check_capacity(plan: Plan, latent_shapes, device: torch.device) -> None:
    if not settings.value("TP2_CAPACITY_CHECK"):
        return
    available = _available_gib(device)
    video = next((tuple(s) for s in latent_shapes or () if len(s) == 5), None)  # [B, C, T, H/16, W/16]
    if available is None or video is None:
        return
    width, height, frames = video[4] * 16, video[3] * 16, capacity.pixel_frames(video[2])
    rows = capacity.tokens(width, height, frames)
    need = capacity.predict_peak_gib(rows, plan.tp_size, _shard_gib(plan), plan.hidden)
    if need <= available:
        return
    what = capacity.advice(width, height, frames, plan.tp_size, available)
    log.warning("%s capacity: %d rows need ~%.1f GiB, %.1f GiB available", STATE.tag, rows, need, available)
    raise CapacityError(
        f"{STATE.tag} this prompt ({width}x{height}, {frames} frames, {rows} sequence rows) needs ~{need:.1f} GiB of GPU "
        f"memory per rank at tp_size {plan.tp_size}, and {available:.1f} GiB is available on {device}: {what}. "
        "(Predicted by tp2/capacity.py for weights resident; TP2_CAPACITY_CHECK=0 tries anyway.)"
    )


def _shard_gib(plan: Plan) -> float:
    return sum(math.prod(ts.local_shape) * DTYPES[ts.dtype].itemsize for ts in plan.tensors.values()) / GIB


def _available_gib(device: torch.device) -> float | None:
    test = settings.value("TP2_TEST_AVAILABLE_GIB")
    if test is not None:
        return test
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return (free + torch.cuda.memory_reserved(device)) / GIB
