"""The loader's numerics check: this rank's int8 path, through the very callables a TP forward uses (int8 GEMM,
q/k norm + rope, attention backend, fused norm when on), measured against exact math (tp2.numerics) once per
device and kernel choice; a path below tp2.numerics.MIN_DB is refused (NumericsError).
"""

from __future__ import annotations

import functools
import platform
from importlib import metadata

import torch

from ..kernels import norm_modulate, qk_norm_rope
from ..kernels.int8_gemm import quantize_int8_convrot
from ..tp2 import settings
from ..tp2.errors import NumericsError
from ..tp2.numerics import AVOID, MIN_DB, BlockPath, NumericsReport, check_block
from .h3_attention import attention_override, norm_rope_
from .state import STATE, log


def check_int8_path(dtype: torch.dtype) -> NumericsReport:
    """Run (or recall) the check for activations of `dtype` on this rank's device; refuse a wrong path."""
    fused = settings.value("TP2_SEQUENCE_PARALLEL") and settings.value("TP2_SP_FUSED_NORM")
    report = _checked(STATE.device, dtype, STATE.int8_gemm.kernel_name, STATE.shares or (1,) * STATE.env.tp_size, fused)
    STATE.numerics = report.summary()
    if report.failing:
        raise NumericsError(_refusal(report))
    return report


@functools.cache
def _checked(device: torch.device, dtype: torch.dtype, kernel: str, shares: tuple, fused: bool) -> NumericsReport:
    report = check_block(_block_path(device, dtype, fused), device, len(shares), _device_name(device), shares=shares)
    (log.error if report.failing else log.info)("%s numerics check of the int8 path: %s", STATE.tag, report.summary())
    return report


def _block_path(device: torch.device, dtype: torch.dtype, fused: bool) -> BlockPath:
    try:
        kitchen = metadata.version("comfy-kitchen")
    except metadata.PackageNotFoundError:
        kitchen = "unknown"
    attention = functools.partial(attention_override(device, dtype), None, skip_reshape=True)  # (q, k, v, heads)
    rope = functools.partial(norm_rope_, fused=fused)
    rope_name = "pack Triton" if fused and qk_norm_rope.triton is not None and device.type == "cuda" else "comfy-kitchen"
    names = {"int8 GEMM": STATE.int8_gemm.kernel_name, "attention": STATE.attention, "q/k norm + rope": rope_name, "comfy-kitchen": kitchen}
    norm = None
    if fused and norm_modulate.available(device, dtype):
        names["norm + modulation"] = "pack Triton"

        def norm(x, w, eps, scale1, shift):
            h = torch.empty_like(x)
            norm_modulate.norm_modulate(x, w, eps, scale1, shift, h)
            return h

    names["wire"] = settings.value("TP2_WIRE")
    return BlockPath(STATE.int8_gemm, quantize_int8_convrot, rope, attention, norm, dtype, STATE.reduce_dtype, names["wire"], names)


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return f"{device.type} ({platform.processor() or platform.machine() or 'unknown'})"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def _refusal(report: NumericsReport) -> str:
    parts = [p for p in report.failing if p != "block"] or ["block"]  # a part that fails explains the block
    worst = parts[0]
    avoid = "; ".join(f"{p}: {AVOID[p]}" for p in parts if p in AVOID) or "TP2_INT8_KERNEL=triton and TP2_ATTN_BACKEND=sdpa"
    return (
        f"{STATE.tag} the int8 path on {report.device} gives wrong numbers: {worst} measured "
        f"{report.parts_db[worst]:.1f} dB against exact math (at least {MIN_DB:.0f} dB expected; healthy paths measure "
        f"30-40 dB). The video would be noise. Full report: {report.summary()}. What avoids it: {avoid}. "
        "Please report the GPU, the driver and the comfy-kitchen version."
    )
