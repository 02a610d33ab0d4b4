"""Fused RMSNorm + adaLN modulation, optionally after the gated residual, for rows of one modulation segment (Triton).

One kernel per segment reads x (and y) once and writes h (and x), where ComfyUI's H3 block makes separate passes:

    x += gate * y                        (addcmul_)          \\ with gate and y: one pass, x updated in place
    h  = rms_norm(x, w, eps)             (F.rms_norm)         |  norm_modulate: the last three in one pass
    h *= 1 + scale;  h += shift          (mul_, add_)        /

It rounds to the activation dtype after the gated add, the norm, the scale and the shift, as ComfyUI's separate ops do
(PyTorch's own norm kernel may round once more inside). Vectors (w, gate, 1 + scale, shift) are [D] in the activation
dtype. `available(device, dtype)` says whether it runs here; callers keep ComfyUI's ops otherwise.
"""

from __future__ import annotations

import torch

from . import triton_probe
from .triton_probe import tl, triton


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether both variants really run here for `dtype` (probed once; see kernels/triton_probe.py)."""
    return triton_probe.runs("norm_modulate", device, dtype, _probe)


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    x, y, v = (torch.ones((2, 64), device=device, dtype=dtype) for _ in range(3))
    norm_modulate(x, v[0], 1e-6, v[0], v[0], y)
    norm_modulate(x, v[0], 1e-6, v[0], v[0], y, v[0], v)


if triton is not None:

    @triton.jit
    def _kernel(x_ptr, y_ptr, gate_ptr, w_ptr, scale1_ptr, shift_ptr, h_ptr, sx, sy, sh, d, eps, GATE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        dt = h_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        if GATE:
            y = tl.load(y_ptr + row * sy + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(gate_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            x = (x + y * g).to(dt)
            tl.store(x_ptr + row * sx + cols, x, mask=mask)
            x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        n = (x * rstd * w).to(dt).to(tl.float32)
        s1 = tl.load(scale1_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        t = (n * s1).to(dt).to(tl.float32)
        b = tl.load(shift_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * sh + cols, (t + b).to(dt), mask=mask)


def norm_modulate(x: torch.Tensor, w: torch.Tensor, eps: float, scale1: torch.Tensor, shift: torch.Tensor, h: torch.Tensor,
                  gate: torch.Tensor | None = None, y: torch.Tensor | None = None) -> None:  # fmt: skip
    """h = rms_norm(x, w, eps) * scale1 + shift, rounded like ComfyUI's three ops; with `gate` and `y`, x += gate * y (in
    place) first. x, y, h: [M, D] row views."""
    rows, d = x.shape
    if rows == 0:
        return
    for t in (x, h) + ((y,) if y is not None else ()):
        if t.stride(-1) != 1:
            raise ValueError("norm_modulate needs rows with contiguous columns")
    block = triton.next_power_of_2(d)
    _kernel[(rows,)](
        x, y if y is not None else x, gate if gate is not None else w, w, scale1, shift, h,
        x.stride(0), (y if y is not None else x).stride(0), h.stride(0), d, float(eps),
        GATE=y is not None, BLOCK=block, num_warps=8 if block >= 4096 else 4,
    )  # fmt: skip
