#!/usr/bin/env python3
"""Synthetic H3 text encoders (Qwen3-VL-32B, 50 layers) with ComfyUI's key names, for tests and benchmarks.

    python scripts/make_tiny_qwen3vl.py OUT.safetensors [--format bf16|int8|fp8|nvfp4] [--seed 0]
    python scripts/make_tiny_qwen3vl.py OUT.safetensors --full-size --format nvfp4   # the real shapes, random data

The keys are the ones ComfyUI 0.33 detects as H3's encoder (`model.layers.*`, `visual.*`; comfy/sd.py
detect_te_model). The tiny dims (TINY) are not ones ComfyUI's stock Qwen3VL_32BConfig builds: test servers
load the fixture tests/comfy/fixtures/h3_tiny_text_encoder, which swaps ComfyUI's config and vision tables
for TINY's (the pack passes the per-rank widths on top, as it does for the real file). Formats, as the
released files store them: int8 (int8_tensorwise, one fp32 scale per output row, comfy-kitchen's quantiser),
fp8 (float8_e4m3fn, one fp32 scale per tensor), nvfp4 (with AWQ pre_quant_scale: `quantize_nvfp4_awq`, in the layout
tp2/nvfp4.py describes; `slice_nvfp4`: what a file of one rank's slice stores, for the tests), bf16.
Only the decoder's seven linears per layer are quantised; the embedding, norms and vision tower stay bf16.
At --full-size the quantised data is random (with realistic scales) instead of quantised from floats.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere
from tp2.nvfp4 import BLOCK, nvfp4_logical_shape, slice_block_scales, swizzle_block_scales  # noqa: E402
from tp2.safetensors_io import PendingTensor, write_streaming  # noqa: E402
from tp2.split import join_or  # noqa: E402

# decoder: hidden, query heads, KV heads, head_dim, FFN; vision tower: hidden, depth, FFN, heads
TINY = dict(hidden=128, heads=16, kv_heads=8, head_dim=32, ffn=256, vision_hidden=64, vision_depth=3, vision_ffn=128, vision_heads=4)
FULL_SIZE = dict(
    hidden=5120, heads=64, kv_heads=8, head_dim=128, ffn=25600, vision_hidden=1152, vision_depth=27, vision_ffn=4304, vision_heads=16
)
LAYERS = 50
VOCAB = 151936
QUANTISED = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
FORMATS = {"int8": "int8_tensorwise", "fp8": "float8_e4m3fn", "nvfp4": "nvfp4"}


def _gen(seed: int, name: str) -> torch.Generator:
    digest = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    return torch.Generator().manual_seed(digest)


def tensor_specs(d: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init kind) of every tensor; kinds: linear, bias, norm, embed."""
    h, q, kv, f = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"], d["ffn"]
    specs = [("model.embed_tokens.weight", (VOCAB, h), "embed")]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), "norm"), (p + "post_attention_layernorm.weight", (h,), "norm"),
            (p + "self_attn.q_proj.weight", (q, h), "linear"), (p + "self_attn.k_proj.weight", (kv, h), "linear"),
            (p + "self_attn.v_proj.weight", (kv, h), "linear"), (p + "self_attn.o_proj.weight", (h, q), "linear"),
            (p + "self_attn.q_norm.weight", (d["head_dim"],), "norm"), (p + "self_attn.k_norm.weight", (d["head_dim"],), "norm"),
            (p + "mlp.gate_proj.weight", (f, h), "linear"), (p + "mlp.up_proj.weight", (f, h), "linear"),
            (p + "mlp.down_proj.weight", (h, f), "linear"),
        ]  # fmt: skip
    return specs + vision_specs(d)


def vision_specs(d: dict) -> list[tuple[str, tuple[int, ...], str]]:
    vh, vf, h = d["vision_hidden"], d["vision_ffn"], d["hidden"]
    merged = 4 * vh  # spatial merge 2 x 2

    def linear(name, rows, cols):
        return [(name + ".weight", (rows, cols), "linear"), (name + ".bias", (rows,), "bias")]

    def norm(name, width):
        return [(name + ".weight", (width,), "norm"), (name + ".bias", (width,), "bias")]

    specs = [("visual.patch_embed.proj.weight", (vh, 3, 2, 16, 16), "linear"), ("visual.patch_embed.proj.bias", (vh,), "bias")]
    specs.append(("visual.pos_embed.weight", (2304, vh), "embed"))
    for i in range(d["vision_depth"]):
        p = f"visual.blocks.{i}."
        specs += norm(p + "norm1", vh) + norm(p + "norm2", vh) + linear(p + "attn.qkv", 3 * vh, vh) + linear(p + "attn.proj", vh, vh)
        specs += linear(p + "mlp.linear_fc1", vf, vh) + linear(p + "mlp.linear_fc2", vh, vf)
    specs += (
        norm("visual.merger.norm", vh) + linear("visual.merger.linear_fc1", merged, merged) + linear("visual.merger.linear_fc2", h, merged)
    )
    for i in range(3):  # ComfyUI's Qwen3-VL DeepStack mergers: one per deepstack index
        p = f"visual.deepstack_merger_list.{i}."
        specs += norm(p + "norm", merged) + linear(p + "linear_fc1", merged, merged) + linear(p + "linear_fc2", h, merged)
    return specs


def make_float(seed: int, name: str, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    g = _gen(seed, name)
    if kind == "linear":
        fan_in = math.prod(shape[1:])
        return torch.randn(shape, generator=g) / math.sqrt(fan_in)
    if kind == "bias":
        return torch.randn(shape, generator=g) * 0.02
    if kind == "norm":
        return 1.0 + torch.randn(shape, generator=g) * 0.1
    return torch.randn(shape, generator=g)  # embed


def quantise(fmt: str, w: torch.Tensor, seed: int, name: str) -> dict[str, torch.Tensor]:
    """One linear's tensors in `fmt`, keyed by suffix ('weight', 'weight_scale', ...), as ComfyUI loads them."""
    if fmt == "int8":
        from comfy_kitchen.tensor import QuantizedTensor

        sd = QuantizedTensor.from_float(w, "TensorWiseINT8Layout", is_weight=True, per_channel=True).state_dict("w")
        return {"weight": sd["w"].contiguous(), "weight_scale": sd["w_scale"].float().reshape(w.shape[0], 1).contiguous()}
    if fmt == "fp8":
        scale = w.abs().amax().float() / 448.0
        return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale.reshape(())}
    if fmt == "nvfp4":
        awq = 0.5 + torch.rand(w.shape[1], generator=_gen(seed, name + ":awq"))
        parts = quantize_nvfp4_awq(w, awq)
        parts.pop("comfy_quant")  # written with the other formats' markers
        return parts
    raise ValueError(fmt)


# nvfp4 files: the quantiser (comfy-kitchen's bytes) and a rank's slice as a file of the local layer stores it
F4_E2M1_MAX = 6.0
F8_E4M3_MAX = 448.0
# Midpoints between consecutive E2M1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6); a value on midpoint i rounds up to
# code i + 1 only when that code is even (round half to even, as comfy-kitchen's _f32_to_floatx_unpacked does).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "comfy_quant")
COMFY_QUANT = json.dumps({"format": "nvfp4"}).encode()


def _check_tensors(tensors: dict[str, torch.Tensor], n: int, k: int) -> None:
    unknown = sorted(set(tensors) - set(SUFFIXES))
    if unknown or "weight" not in tensors or "weight_scale" not in tensors:
        raise ValueError(
            f"slice_nvfp4 takes the tensors of one nvfp4 linear keyed by suffix ({', '.join(SUFFIXES)}; weight and "
            f"weight_scale required), got {sorted(tensors)}. Slice a bias like any plain tensor."
        )
    weight = tensors["weight"]
    stored = (_roundup(n, 16), _roundup(k, 16) // 2)
    if weight.dtype != torch.uint8 or tuple(weight.shape) != stored:
        raise ValueError(
            f"nvfp4 weight is {weight.dtype} {list(weight.shape)}, but a layer of logical shape [{n}, {k}] stores "
            f"uint8 {list(stored)} (two fp4 values a byte, padded to multiples of 16). Pass the module's "
            "(out_features, in_features) as shape= when they are not multiples of 16."
        )


def _why(n: int, k: int, dim: int, tp_size: int) -> str | None:
    if dim == 0:
        return f"its {n} output rows are not divisible by tp_size={tp_size}." if n % tp_size else None
    if k % tp_size:
        return f"its input dim K={k} is not divisible by tp_size={tp_size}."
    if (k // tp_size) % BLOCK:
        return (
            f"the local K ({k // tp_size}) is not a multiple of {BLOCK}, so a rank's slice would cut a {BLOCK}-column "
            f"nvfp4 block (one fp8 block scale per {BLOCK} input columns)."
        )
    return None


def nvfp4_split_problem(n: int, k: int, dim: int, tp_size: int) -> str | None:
    """Why an nvfp4 weight of logical shape [n, k] cannot be cut along `dim` (0: output rows, 1: input columns) into
    tp_size equal slices, and the tp_sizes that can, or None. Rows split anywhere (each row's blocks run along K); a K
    slice must hold whole 16-column blocks, since each block scale covers 16 input columns. The swizzle imposes
    nothing: a local scale tensor is re-swizzled (and padded to 128 x 4) for its own shape."""
    why = _why(n, k, dim, tp_size)
    if why is None:
        return None
    ok = [t for t in (2, 4, 8) if _why(n, k, dim, t) is None]
    return f"{why} Use tp_size {join_or(ok)}." if ok else f"{why} Run this layer unsplit (tp_size 1)."


def slice_nvfp4(
    tensors: dict[str, torch.Tensor], dim: int, tp_rank: int, tp_size: int, *, shape: tuple[int, int] | None = None
) -> dict[str, torch.Tensor]:
    """This rank's tensors of ONE nvfp4 linear, keyed by suffix: dim 0 (colwise) cuts the output rows, dim 1
    (rowwise) the input columns and pre_quant_scale; the scalars and comfy_quant stay whole. The result is what a
    ComfyUI file for the local layer would store (weight rows padded to 16, scales re-swizzled). `shape` is the
    logical [n, k]; by default the stored weight's (padding included)."""
    weight = tensors.get("weight")
    if shape is None and weight is not None:
        shape = nvfp4_logical_shape(weight.shape)
    n, k = shape or (0, 0)
    _check_tensors(tensors, n, k)
    problem = nvfp4_split_problem(n, k, dim, tp_size)
    if problem:
        raise ValueError(f"Cannot split an nvfp4 weight [{n}, {k}] along dim {dim}: {problem}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}.")
    out = dict(tensors)
    width = (n if dim == 0 else k) // tp_size
    out["weight_scale"] = slice_block_scales(tensors["weight_scale"], n, k, dim, tp_rank * width, (tp_rank + 1) * width)
    if dim == 0:
        local = n // tp_size
        mine = weight.narrow(0, tp_rank * local, local)
        out["weight"] = torch.zeros((_roundup(local, 16), weight.shape[1]), dtype=torch.uint8, device=weight.device)
        out["weight"][:local] = mine
        return out
    local = k // tp_size
    out["weight"] = weight.narrow(1, tp_rank * local // 2, local // 2).contiguous()
    if "pre_quant_scale" in tensors:
        out["pre_quant_scale"] = tensors["pre_quant_scale"].narrow(-1, tp_rank * local, local).contiguous()
    return out


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 values already in [-6, 6] -> 4-bit E2M1 codes (sign in bit 3), round half to even; -0 keeps its sign."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        code += (mag > mid) | ((mag == mid) & (i % 2 == 1))
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def _quantize_blocks(w: torch.Tensor, per_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """comfy-kitchen's eager quantize_nvfp4 (pad_16x): packed codes [rows, cols/2] and row-major fp8 scales."""
    rows, cols = _roundup(w.shape[0], 16), _roundup(w.shape[1], 16)
    w = torch.nn.functional.pad(w, (0, cols - w.shape[1], 0, rows - w.shape[0]))
    blocks = w.reshape(rows, cols // BLOCK, BLOCK)
    scales = torch.clamp(blocks.abs().amax(dim=-1).to(torch.float32) / F4_E2M1_MAX / per_tensor, max=F8_E4M3_MAX)
    scales_fp8 = scales.to(torch.float8_e4m3fn)
    total = per_tensor * scales_fp8.to(torch.float32)
    zero = total == 0  # all-zero blocks (padding): 0 / 0 would be NaN
    data = blocks.float() / torch.where(zero, torch.ones_like(total), total).unsqueeze(-1)
    data = torch.where(zero.unsqueeze(-1), torch.zeros_like(data), data)
    codes = _e2m1_codes(torch.clamp(data, -F4_E2M1_MAX, F4_E2M1_MAX).reshape(rows, cols))
    return (codes[:, 0::2] << 4) | codes[:, 1::2], scales_fp8


def quantize_nvfp4_awq(
    w: torch.Tensor, pre_quant_scale: torch.Tensor | None, *, input_scale: torch.Tensor | float | None = None
) -> dict[str, torch.Tensor]:
    """The tensors a ComfyUI nvfp4 file stores for the linear weight `w` [n, k], keyed by suffix. With AWQ the
    quantised weight is w / pre_quant_scale (per input column, in float32), since the layer multiplies its input by
    pre_quant_scale; that is stored as given. Bit for bit comfy-kitchen's quantize_nvfp4 with ComfyUI's
    weight_scale_2 = amax(|w|) / (448 * 6) (comfy/quant_ops.py TensorCoreNVFP4Layout.quantize)."""
    if w.dim() != 2:
        raise ValueError(f"nvfp4 quantises 2-D weights, got shape {list(w.shape)}.")
    if pre_quant_scale is not None and tuple(pre_quant_scale.shape) != (w.shape[1],):
        raise ValueError(f"pre_quant_scale has shape {list(pre_quant_scale.shape)}; the weight has K={w.shape[1]}.")
    smoothed = w if pre_quant_scale is None else w.float() / pre_quant_scale.float()
    per_tensor = (smoothed.abs().amax() / (F8_E4M3_MAX * F4_E2M1_MAX)).to(torch.float32)
    packed, scales = _quantize_blocks(smoothed, per_tensor)
    out = {
        "weight": packed,
        "weight_scale": swizzle_block_scales(scales),
        "weight_scale_2": per_tensor,
        "comfy_quant": torch.frombuffer(bytearray(COMFY_QUANT), dtype=torch.uint8),
    }
    if input_scale is not None:
        out["input_scale"] = torch.as_tensor(input_scale, dtype=torch.float32).reshape(())
    if pre_quant_scale is not None:
        out["pre_quant_scale"] = pre_quant_scale
    return out


def _roundup(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def pending_tensors(d: dict, fmt: str, seed: int, full_size: bool) -> list[PendingTensor]:
    out = []
    marker = json.dumps({"format": FORMATS[fmt]}).encode() if fmt in FORMATS else b""
    for name, shape, kind in tensor_specs(d):
        layer = name[: -len(".weight")]
        if not (marker and name.endswith(".weight") and layer.endswith(QUANTISED)):
            out.append(
                PendingTensor(name, torch.bfloat16, shape, lambda n=name, s=shape, k=kind: make_float(seed, n, s, k).to(torch.bfloat16))
            )
            continue
        cache: dict[str, torch.Tensor] = {}

        def part(suffix, n=name, s=shape, cache=cache):  # one layer's parts are made together, when first written
            if not cache:
                cache.update(_quantised_parts(fmt, n, s, seed, full_size))
            return cache.pop(suffix)

        for suffix, (dtype, part_shape) in part_specs(fmt, shape).items():
            out.append(PendingTensor(f"{layer}.{suffix}", dtype, part_shape, lambda sfx=suffix, part=part: part(sfx)))
        out.append(
            PendingTensor(
                f"{layer}.comfy_quant", torch.uint8, (len(marker),), lambda: torch.frombuffer(bytearray(marker), dtype=torch.uint8)
            )
        )
    return out


def part_specs(fmt: str, shape: tuple[int, int]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Suffix -> (dtype, shape) of one quantised linear's tensors, in the order they are written."""
    if fmt == "int8":
        return {"weight": (torch.int8, shape), "weight_scale": (torch.float32, (shape[0], 1))}
    if fmt == "fp8":
        return {"weight": (torch.float8_e4m3fn, shape), "weight_scale": (torch.float32, ())}
    n, k = shape  # nvfp4 (tp2/nvfp4.py): packed codes, swizzled fp8 block scales, per-tensor scale, AWQ smoothing
    return {
        "weight": (torch.uint8, (n, k // 2)),
        "weight_scale": (torch.float8_e4m3fn, (-(-n // 128) * 128, -(-(k // 16) // 4) * 4)),
        "weight_scale_2": (torch.float32, ()),
        "pre_quant_scale": (torch.float32, (k,)),
    }


def _quantised_parts(fmt, name, shape, seed, full_size) -> dict[str, torch.Tensor]:
    if not full_size:
        return quantise(fmt, make_float(seed, name, shape, "linear"), seed, name)
    g = _gen(seed, name)
    if fmt == "int8":  # random int8 with the scale of a fan-in init: std(int8 uniform) ~ 73.3
        q = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        return {"weight": q, "weight_scale": torch.full((shape[0], 1), 1.0 / (73.3 * math.sqrt(shape[1])))}
    if fmt == "fp8":
        q = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": torch.tensor(0.01 / math.sqrt(shape[1]))}
    specs = part_specs(fmt, shape)  # nvfp4: random codes, block scales near 1, the per-tensor scale of a fan-in init
    return {
        "weight": torch.randint(0, 256, specs["weight"][1], generator=g, dtype=torch.uint8),
        "weight_scale": (0.75 + 0.5 * torch.rand(specs["weight_scale"][1], generator=g)).to(torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(1.0 / (2.5 * math.sqrt(shape[1]))),
        "pre_quant_scale": 0.5 + torch.rand(shape[1], generator=g),
    }


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--format", choices=("bf16", *FORMATS), default="bf16")
    ap.add_argument("--full-size", action="store_true", help="the real Qwen3-VL-32B shapes (random data)")
    ap.add_argument(
        "--ffn",
        type=int,
        help="decoder FFN width instead of the preset's (a decoder-heavy file; the pack's servers build it from the shapes)",
    )
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    d = dict(FULL_SIZE if a.full_size else TINY, **({"ffn": a.ffn} if a.ffn else {}))
    tensors = pending_tensors(d, a.format, a.seed, a.full_size)

    def progress(i: int, n: int) -> None:
        if a.full_size and (i == n or i % 50 == 0):
            print(f"\r  {i}/{n} tensors", end="" if i < n else "\n", file=sys.stderr, flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    write_streaming(a.out, tensors, None, progress)
    print(f"{a.out}: {len(tensors)} tensors, {os.path.getsize(a.out) / 1e6:.1f} MB, {a.format}, dims {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
