"""The sequence-parallel blocks' norms: fused (TP2_SP_FUSED_NORM=1, CUDA with Triton), norm + modulation with the
gated residual before it as one kernel per modulation segment (kernels/norm_modulate.py); else ComfyUI's ops.
"""

from __future__ import annotations

import comfy.model_management
import torch

from ..kernels import norm_modulate
from .state import STATE


def fused_norm_ok(block, x: torch.Tensor, segments) -> bool:
    """Whether this block's norms can run fused here: CUDA with Triton, plain norm weights (no weight function, e.g.
    a LoRA patch applied on the fly), and segments that tile this rank's rows from the first one on."""
    if not (STATE.sp_fused_norm and norm_modulate.available(x.device, x.dtype)):
        return False
    if any(n.weight is None or n.weight_function or n.bias_function for n in (block.norm1, block.norm2)):
        return False
    return all(a == (segments[i - 1][1] if i else 0) for i, (a, _b, _row) in enumerate(segments))


def gated_norm(h3, fused: bool, x, norm, shift, scale, segments, gate=None, y=None):
    """(x, its modulated norm) after x += gate * y where given. Without `fused`: ComfyUI's ops (h3's _mod_gate and
    _mod_scale_shift). With it: rms_norm(x) * (1 + scale) + shift per segment in one kernel each (x += gate * y in
    place in it); rows after the last segment (the zero pad rows) get the plain norm of zero rows, as in ComfyUI's ops: zeros."""
    if not fused:
        if gate is not None:
            x = h3._mod_gate(x, gate, y, segments)
        return x, h3._mod_scale_shift(norm(x), shift, scale, segments)
    h = torch.empty_like(x)
    w = comfy.model_management.cast_to(norm.weight, dtype=x.dtype, device=x.device)
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    scale1, shift = 1.0 + scale.to(x.dtype), shift.to(x.dtype)  # every modulation row at once, as ComfyUI makes each
    gate = gate.to(x.dtype) if gate is not None else None
    for a, b, row in segments:
        residual = () if gate is None else (gate[row], y[a:b])
        norm_modulate.norm_modulate(x[a:b], w, eps, scale1[row], shift[row], h[a:b], *residual)
    h[segments[-1][1] if segments else 0 :].zero_()
    return x, h
