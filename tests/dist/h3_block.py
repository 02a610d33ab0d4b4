"""The reference H3 DiT block (tp2.numerics.block) on a checkpoint's weights, for the TP tests.

`block_forward` runs one block given a table of linears; the reference table uses the full weights directly
(F.linear, or comfy-kitchen's int8_linear), the TP table runs tp2.layers' local GEMM and row-parallel sum on one
rank's shard. It returns the
intermediates the tests compare: the column-parallel qkv and fc1 outputs, the row-parallel attention and MLP
outputs (after their all-reduce), and the block output.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from tp2.checkpoint import convrot_group
from tp2.layers import Int8Weight, LinearWeight, apply_input_act, local_linear, row_parallel
from tp2.numerics import block
from tp2.plan import COLWISE, COLWISE_PACKED, REPLICATE, ROWWISE, ROWWISE_SPLIT_INPUT


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def weight_from_state_dict(sd: dict[str, torch.Tensor], prefix: str) -> LinearWeight:
    """The weight of layer `prefix` (e.g. 'blocks.0.mlp.fc2.') as float tensor or Int8Weight."""
    marker = sd.get(prefix + "comfy_quant")
    if marker is None:
        return sd[prefix + "weight"]
    conf = json.loads(bytes(marker.cpu().numpy().tobytes()))
    return Int8Weight(sd[prefix + "weight"], sd[prefix + "weight_scale"].float(), convrot_group(conf))


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


class LinearOps:
    """The block's calls in one process: `lin`'s linears (a TP rank's, whose row-parallel layers all-reduce, or the
    full reference), the norms of the checkpoint's block at `prefix`, plain torch attention, no rope."""

    ranks = (0,)

    def __init__(self, lin: dict, sd: dict, prefix: str, head_dim: int):
        self.lin, self.sd, self.prefix, self.head_dim = lin, sd, prefix, head_dim

    def norm(self, x, which, scale1, shift):
        return rms_norm(x, self.sd[f"{self.prefix}norm{which + 1}.weight"].float()) * scale1 + shift

    def column(self, name, h, rank):
        return self.lin[name](h)

    def row(self, name, a, rank, input_act=None):
        return self.lin[name](a, input_act=input_act)

    def qk(self, q, k):
        q.copy_(rms_norm(q, self.sd[self.prefix + "attn.q_norm.weight"].float()))
        k.copy_(rms_norm(k, self.sd[self.prefix + "attn.k_norm.weight"].float()))

    @staticmethod
    def attention(q, k, v, heads):
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, q.shape[2], -1)

    @staticmethod
    def reduce(parts):
        return parts[0]


def block_forward(x, t_emb, lin: dict, sd: dict, prefix: str, head_dim: int, adaln_silu: bool) -> dict:
    """One DiT block of two modalities (each its own modulation row); `lin` maps qkv/out/fc1/fc2/adaln to callables."""
    s, hidden = x.shape
    mods = lin["adaln"](F.silu(t_emb) if adaln_silu else t_emb)  # [M, 18h]
    mods = mods.view(mods.shape[0] * 3, 6 * hidden).chunk(6, dim=-1)
    seen = {}
    out = block(x, mods, [(0, s // 2, 0), (s // 2, s, 1)], LinearOps(lin, sd, prefix, head_dim), seen)
    return {"adaln": torch.cat(mods, -1), **seen, **out}


LAYERS = {"qkv": "attn.qkv_proj", "out": "attn.out_proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2", "adaln": "adaln_proj.linear"}


def reference_linears(sd, prefix):
    return {k: reference_linear(sd, prefix + v + ".") for k, v in LAYERS.items()}


def tp_linear(plan, layer: str, sd: dict, tp, gemm, reduce_dtype):
    """This rank's linear for plan layer `layer`: column-parallel and replicated ones the local GEMM, row-parallel
    ones tp2.layers.row_parallel (split-input ones on this rank's K slice of the replicated input)."""
    prefix = plan.prefix + layer + "."
    weight, bias, style = weight_from_state_dict(sd, prefix), sd.get(prefix + "bias"), plan.linears[layer]
    if style in (COLWISE, COLWISE_PACKED, REPLICATE):
        return lambda x, input_act=None: local_linear(x, weight, bias, x.dtype, gemm, input_act)
    if style not in (ROWWISE, ROWWISE_SPLIT_INPUT):
        raise ValueError(f"Unknown style '{style}' for '{layer}'.")

    def run(x, input_act=None):
        if style == ROWWISE_SPLIT_INPUT:
            bounds = plan.tensors[prefix + "weight"].bounds
            x = x.narrow(-1, bounds[tp.tp_rank], bounds[tp.tp_rank + 1] - bounds[tp.tp_rank])
        return row_parallel(x, weight, bias, tp, gemm, reduce_dtype, input_act)

    return run


def tp_linears(plan, sd, block, tp, gemm, reduce_dtype=torch.float32):
    return {k: tp_linear(plan, f"{block}.{v}", sd, tp, gemm, reduce_dtype) for k, v in LAYERS.items()}
