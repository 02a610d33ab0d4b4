"""H3's attention under TP. `attention_override`: which of ComfyUI's attention functions the TP forward uses on a device
(TP2_ATTN_BACKEND), chosen once per device and compute dtype by kernels/attention.py among the candidates that really
run there. `attention_forward`: the sequence-parallel blocks' Attention.forward, ComfyUI's step for step but for two changes:

1. No copy of v when the attention backend is comfy-kitchen's INT8 one, which reads q, k and v as strided views of
   the qkv buffer and frees all three together (the clone changes no bit; other backends keep it).
2. With `fused` (TP2_SP_FUSED_NORM=1), the per-head q/k RMSNorm + rope runs as kernels/qk_norm_rope.py's Triton
   kernel instead of comfy-kitchen's wherever it runs: same roundings.
"""

from __future__ import annotations

import functools

import comfy.cli_args as cli_args
import comfy.ldm.modules.attention as comfy_attention
import comfy.model_management
import comfy.quant_ops
import torch

from ..kernels import qk_norm_rope
from ..kernels.attention import select_attention
from ..tp2 import settings
from ..tp2.layers import Reduction
from .parallel import rowwise_call
from .state import STATE, log


def _quantises_views(h3, transformer_options) -> bool:
    """Whether the attention call below ends in comfy-kitchen's INT8 container path, which reads the q/k/v views."""
    ck = comfy_attention.attention_comfy_kitchen_int8
    override = transformer_options.get("optimized_attention_override")
    if override is not None:
        return getattr(override, "container_function", None) is ck.container_function
    return h3.optimized_attention is ck


def norm_rope_(q, k, table, qw, kw, eps, fused: bool) -> None:
    """The q/k RMSNorm + rope in place, [s, heads, head_dim]: with `fused` the pack's kernel where it runs, else comfy-kitchen's."""
    if fused and qk_norm_rope.available(q, k, table):
        qk_norm_rope.rms_rope_split_half_(q, k, table, qw, kw, eps)
    else:
        comfy.quant_ops.ck.rms_rope_split_half_(q[None], k[None], table, qw, kw, epsilon=eps, rot_dim=2 * table.shape[-3])


def attention_forward(h3, attn, x, rope_freqs, transformer_options: dict, fused=False, out_reduce: Reduction | None = None) -> torch.Tensor:
    """ComfyUI's `h3.Attention.forward(attn, x, ...)` (h3: comfy.ldm.minimax.model), with the two changes above. With
    `out_reduce`, the row-parallel out_proj reduces as it says; without, out_proj runs its own forward. `x` may come
    in a one-item list, which this empties, so the rows are freed as soon as qkv_proj has read them."""
    qkv = attn.qkv_proj(x.pop() if isinstance(x, list) else x)
    del x
    s, device = qkv.shape[0], qkv.device
    q, k, v = (t.view(s, attn.heads, attn.head_dim) for t in qkv.split(attn.heads * attn.head_dim, dim=-1))
    del qkv  # q, k and v are its views: comfy-kitchen's INT8 attention frees the buffer once it has quantised them
    if rope_freqs is not None:
        qw = comfy.model_management.cast_to(attn.q_norm.weight, device=device)
        kw = comfy.model_management.cast_to(attn.k_norm.weight, device=device)
        if comfy.model_management.in_training:
            rot = rope_freqs.shape[-3] * 2
            q, k = comfy.quant_ops.ck.rms_rope_split_half(q[None], k[None], rope_freqs, qw, kw, epsilon=attn.q_norm.eps, rot_dim=rot)
            q, k = q[0], k[0]
        else:
            norm_rope_(q, k, rope_freqs, qw, kw, attn.q_norm.eps, fused)
    else:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if not _quantises_views(h3, transformer_options):
        v = v.clone()
    q, k, v = (comfy_attention.AttentionTensorContainer(t.transpose(0, 1).unsqueeze(0)) for t in (q, k, v))
    out = h3.optimized_attention(q, k, v, attn.heads, mask=None, skip_reshape=True, transformer_options=transformer_options).squeeze(0)
    return attn.out_proj(out) if out_reduce is None else rowwise_call(attn.out_proj, out, reduce=out_reduce)


@functools.cache
def attention_override(device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """ComfyUI's attention function for the backend TP2_ATTN_BACKEND resolves to on this device in `dtype`; at auto,
    ComfyUI's own where it was started with --use-sage-attention or --use-flash-attention (each rank runs attention
    on its own heads, so any kernel does)."""
    flag = next((f"--use-{n}-attention" for n in ("sage", "flash") if getattr(cli_args.args, f"use_{n}_attention")), None)
    if flag and settings.value("TP2_ATTN_BACKEND") == "auto":
        STATE.attention = f"ComfyUI's ({flag})"
        log.info("%s attention: ComfyUI's own, as %s asks (TP2_ATTN_BACKEND=auto)", STATE.tag, flag)
        return lambda func, *args, **kwargs: comfy_attention.optimized_attention(*args, **kwargs)

    def sdpa(func, *args, **kwargs):
        return comfy_attention.attention_pytorch(*args, **kwargs)

    def ck(func, *args, **kwargs):
        return comfy_attention.attention_comfy_kitchen_int8(*args, **kwargs)

    ck.container_function = comfy_attention.attention_comfy_kitchen_int8.container_function
    candidates = {
        "sdpa": (_probe(comfy_attention.attention_pytorch, device, dtype), "needs torch SDPA"),
        "ck": (_probe(comfy_attention.attention_comfy_kitchen_int8, device, dtype), "comfy-kitchen INT8 attention failed a real call here"),
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
