"""Which of ComfyUI's attention functions the TP forward uses on a device (TP2_ATTN_BACKEND), as ComfyUI's
`optimized_attention_override`: chosen once per device and compute dtype by kernels/attention.py among the
candidates that really run here in that dtype.
"""

from __future__ import annotations

import functools

import torch

from ..kernels.attention import select_attention
from ..tp2 import settings
from .state import STATE


@functools.cache
def attention_override(device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """ComfyUI's attention function for the backend TP2_ATTN_BACKEND resolves to on this device in `dtype`."""
    import comfy.ldm.modules.attention as attn

    def sdpa(func, *args, **kwargs):
        return attn.attention_pytorch(*args, **kwargs)

    def ck(func, *args, **kwargs):
        return attn.attention_comfy_kitchen_int8(*args, **kwargs)

    ck.container_function = attn.attention_comfy_kitchen_int8.container_function
    candidates = {
        "sdpa": (_probe(attn.attention_pytorch, device, dtype), "needs torch SDPA"),
        "ck": (_probe(attn.attention_comfy_kitchen_int8, device, dtype), "comfy-kitchen INT8 attention failed a real call here"),
    }
    choice = select_attention(candidates, device, settings.value("TP2_ATTN_BACKEND"), dtype=dtype)
    STATE.attention = choice
    return {"sdpa": sdpa, "ck": ck}[choice]


def _probe(fn, device, dtype):
    """fn as fn(q, k, v, heads) if one real call on this device in `dtype` works, else None (trust a real call)."""
    call = functools.partial(fn, skip_reshape=True)
    q = torch.randn(1, 2, 64, 128, device=device, dtype=dtype if device.type == "cuda" else torch.float32)
    try:
        call(q, q, q, 2)
        return call
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return None
