#!/usr/bin/env python3
"""Synthetic H3 text encoders (Qwen3-VL-32B, 50 layers) with ComfyUI's key names, for tests and benchmarks.

    python scripts/make_tiny_qwen3vl.py OUT.safetensors [--format bf16|int8|fp8|nvfp4] [--seed 0]
    python scripts/make_tiny_qwen3vl.py OUT.safetensors --full-size --format nvfp4   # the real shapes, random data

The keys are the ones ComfyUI 0.33 detects as H3's encoder (`model.layers.*`, `visual.*`; comfy/sd.py
detect_te_model). The tiny dims (TINY) are not ones ComfyUI's stock Qwen3VL_32BConfig builds: test servers
load the fixture tests/comfy/fixtures/h3_tiny_text_encoder, which swaps ComfyUI's config and vision tables
for TINY's (the pack passes the per-rank widths on top, as it does for the real file). Formats, as the
released files store them: int8 (int8_tensorwise, one fp32 scale per output row, comfy-kitchen's quantiser),
fp8 (float8_e4m3fn, one fp32 scale per tensor), nvfp4 (with AWQ pre_quant_scale; tp2/nvfp4.py), bf16.
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
from tp2.safetensors_io import PendingTensor, write_streaming  # noqa: E402

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
        from tp2.nvfp4 import quantize_nvfp4_awq

        awq = 0.5 + torch.rand(w.shape[1], generator=_gen(seed, name + ":awq"))
        parts = quantize_nvfp4_awq(w, awq)
        parts.pop("comfy_quant")  # written with the other formats' markers
        return parts
    raise ValueError(fmt)


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
