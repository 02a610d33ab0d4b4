"""Which of ComfyUI's attention functions the TP forward uses on a device (TP2_ATTN_BACKEND), as an override.

attention_override(device)   ComfyUI's `optimized_attention_override` callable for the chosen backend, chosen once
                             per device by kernels/attention.py among the candidates that really run here
"""

from __future__ import annotations

import functools

import torch

from ..kernels.attention import select_attention
from ..tp2 import settings
from .state import STATE


@functools.cache
def attention_override(device: torch.device):
    """ComfyUI's attention function for the backend TP2_ATTN_BACKEND resolves to on this device."""
    import comfy.ldm.modules.attention as attn

    def sdpa(func, *args, **kwargs):
        return attn.attention_pytorch(*args, **kwargs)

    def ck(func, *args, **kwargs):
        return attn.attention_comfy_kitchen_int8(*args, **kwargs)

    ck.container_function = attn.attention_comfy_kitchen_int8.container_function
    candidates = {
        "sdpa": (_probe(attn.attention_pytorch, device), "needs torch SDPA"),
        "ck": (_probe(attn.attention_comfy_kitchen_int8, device), "comfy-kitchen INT8 attention failed a real call here"),
    }
    choice = select_attention(candidates, device, settings.value("TP2_ATTN_BACKEND"))
    STATE.attention = choice
    return {"sdpa": sdpa, "ck": ck}[choice]


def _probe(fn, device):
    """fn as fn(q, k, v, heads) if one real call on this device works, else None (trust a real call, not a flag)."""
    call = functools.partial(fn, skip_reshape=True)
    q = torch.randn(1, 2, 64, 128, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        call(q, q, q, 2)
        return call
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return None
