"""A reference MiniMax-H3 DiT block written from the shapes in the brief (not ComfyUI's code), for TP tests.

`block_forward` runs one block given a table of linears; the reference table uses the full weights directly
(F.linear, or comfy-kitchen's int8_linear), the TP table uses tp2.layers on one rank's shard. It returns the
intermediates the tests compare: the column-parallel qkv and fc1 outputs, the row-parallel attention and MLP
outputs (after their all-reduce), and the block output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tp2.layers import Int8Weight, apply_input_act, build_linear, weight_from_state_dict


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_linear(sd: dict, prefix: str):
    """Y = X A^T (+ b) on the full weight, fp32 out: the single-process ground truth."""
    weight = weight_from_state_dict(sd, prefix)
    bias = sd.get(prefix + "bias")

    def run(x, input_act=None):
        if isinstance(weight, Int8Weight):
            import comfy_kitchen as ck

            return ck.int8_linear(x, weight.qdata, weight.scale, bias, torch.float32, convrot=weight.convrot_group is not None,
                                  convrot_groupsize=weight.convrot_group or 256, input_act=input_act)  # fmt: skip
        return F.linear(apply_input_act(x, input_act).float(), weight.float(), None if bias is None else bias.float())

    return run


def block_forward(x, t_emb, lin: dict, sd: dict, prefix: str, head_dim: int, adaln_silu: bool) -> dict:
    """One DiT block; `lin` maps qkv/out/fc1/fc2/adaln to callables; norms come from `sd`."""
    s, hidden = x.shape
    mods = lin["adaln"](F.silu(t_emb) if adaln_silu else t_emb)  # [M, 18h]
    mods = mods.view(mods.shape[0] * 3, 6 * hidden).chunk(6, dim=-1)
    shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = mods
    segments = [(0, s // 2, 0), (s // 2, s, 1)]  # two modalities, each its own modulation row

    def modulate(h, shift, scale):
        return torch.cat([h[a:b] * (1 + scale[r]) + shift[r] for a, b, r in segments])

    def gated(x, gate, y):
        return torch.cat([x[a:b] + gate[r] * y[a:b] for a, b, r in segments])

    h = modulate(rms_norm(x, sd[prefix + "norm1.weight"].float()), shift_a, scale_a)
    qkv = lin["qkv"](h)
    q, k, v = qkv.float().chunk(3, dim=-1)
    heads = q.shape[-1] // head_dim
    q = rms_norm(q.view(s, heads, head_dim), sd[prefix + "attn.q_norm.weight"].float())
    k = rms_norm(k.view(s, heads, head_dim), sd[prefix + "attn.k_norm.weight"].float())
    v = v.view(s, heads, head_dim)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1).reshape(s, -1)
    attn_out = lin["out"](att)
    x = gated(x, gate_a, attn_out)
    h = modulate(rms_norm(x, sd[prefix + "norm2.weight"].float()), shift_m, scale_m)
    fc1 = lin["fc1"](h)
    mlp_out = lin["fc2"](fc1, input_act="swiglu")
    out = gated(x, gate_m, mlp_out)
    return {"adaln": torch.cat(mods, -1), "qkv": qkv, "att": att, "attn_out": attn_out, "fc1": fc1, "mlp_out": mlp_out, "out": out}


LAYERS = {"qkv": "attn.qkv_proj", "out": "attn.out_proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2", "adaln": "adaln_proj.linear"}


def reference_linears(sd, prefix):
    return {k: reference_linear(sd, prefix + v + ".") for k, v in LAYERS.items()}


def tp_linears(plan, sd, block, tp, gemm, reduce_dtype=torch.float32):
    return {k: build_linear(plan, f"{block}.{v}", sd, tp, gemm, reduce_dtype) for k, v in LAYERS.items()}
