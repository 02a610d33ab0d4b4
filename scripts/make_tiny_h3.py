#!/usr/bin/env python3
"""Synthetic MiniMax-H3 checkpoints (and matching conditioning files) for tests, demos and benchmarks.

    python scripts/make_tiny_h3.py OUT.safetensors [--int8] [--hidden 256] [--heads 4] [--head-dim 128]
        [--ffn 512] [--layers 2] [--refiner-layers 1] [--text-dim 128] [--adaln curve|full] [--seed 0]
    python scripts/make_tiny_h3.py OUT.safetensors --full-size --int8      # the real 50-block shapes, random int8
    python scripts/make_tiny_h3.py --conditioning OUT.safetensors --text-dim 128 --tokens 16 [--seed 0]
    python scripts/make_tiny_h3.py --vae OUT.safetensors [--seed 0]   # a 22 MB video VAE for the tiny latents

The key layout is the one ComfyUI 0.33 detects as MiniMax-H3. Init is "strong" on purpose: fan-in scaled
linears and adaln gate biases of 1, so every block moves the output by tens of percent and a wrong shard or a
missing all-reduce cannot hide under 1e-3 noise. `--int8` quantises the four big linears of every block and
refiner block with comfy-kitchen's own ConvRot quantiser (per-row scales, `comfy_quant` markers); at
`--full-size` it writes random int8 data with realistic scales instead (the arithmetic is the same, and
quantising 20 GB on a CPU would take hours). Files are written one tensor at a time.
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
from tp2.safetensors_io import DTYPE_CODES, PendingTensor, write_streaming  # noqa: E402

QUANTISED = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
FULL_SIZE = dict(hidden=5376, heads=56, head_dim=128, ffn=14336, layers=50, refiner_layers=2, text_dim=5120, curve_grid=1025)


def _gen(seed: int, name: str) -> torch.Generator:
    digest = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    return torch.Generator().manual_seed(digest)


def _randn(seed, name, shape, std, dtype):
    return (torch.randn(shape, generator=_gen(seed, name)) * std).to(dtype)


def layer_specs(a) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init kind) of every tensor; kinds: linear, bias, adaln_bias, norm, rope, table, fp32 variants."""
    h, inner, f, t = a.hidden, a.heads * a.head_dim, a.ffn, a.time_embed_dim
    specs = [
        ("video_patch_proj.weight", (h, 96), "linear32"), ("video_patch_proj.bias", (h,), "bias32"),
        ("audio_patch_proj.weight", (h, 32), "linear32"), ("audio_patch_proj.bias", (h,), "bias32"),
        ("condition_proj.weight", (h, a.text_dim), "linear"), ("condition_proj.bias", (h,), "bias"),
        ("rope.inv_freq", (16,), "rope"),
    ]  # fmt: skip
    if a.adaln == "curve":
        specs.append(("adaln_t_table", (a.curve_grid, t), "table"))
    else:
        specs += [
            ("time_embedder.proj_in.weight", (h, 256), "linear32"), ("time_embedder.proj_in.bias", (h,), "bias32"),
            ("time_embedder.proj_out.weight", (t, h), "linear32"), ("time_embedder.proj_out.bias", (t,), "bias32"),
        ]  # fmt: skip

    def block(p: str, adaln: bool) -> None:
        specs.extend([
            (f"{p}.norm1.weight", (h,), "norm"), (f"{p}.norm2.weight", (h,), "norm"),
            (f"{p}.attn.qkv_proj.weight", (3 * inner, h), "linear"),
            (f"{p}.attn.q_norm.weight", (a.head_dim,), "norm"), (f"{p}.attn.k_norm.weight", (a.head_dim,), "norm"),
            (f"{p}.attn.out_proj.weight", (h, inner), "linear"),
            (f"{p}.mlp.fc1.weight", (2 * f, h), "linear"), (f"{p}.mlp.fc2.weight", (h, f), "linear"),
        ])  # fmt: skip
        if adaln:
            specs.extend(
                [(f"{p}.adaln_proj.linear.weight", (18 * h, t), "adaln"), (f"{p}.adaln_proj.linear.bias", (18 * h,), "adaln_bias")]
            )

    for i in range(a.refiner_layers):
        block(f"token_refiner.blocks.{i}", adaln=False)
    specs.append(("token_refiner.final_norm.weight", (h,), "norm"))
    for i in range(a.layers):
        block(f"blocks.{i}", adaln=True)
    specs += [
        ("final_layer.norm.weight", (h,), "norm"),
        ("final_layer.adaln_proj.linear.weight", (2 * h, t), "adaln"), ("final_layer.adaln_proj.linear.bias", (2 * h,), "bias32"),
        ("final_layer.video_out.weight", (96, h), "linear32"), ("final_layer.video_out.bias", (96,), "bias32"),
        ("final_layer.audio_out.weight", (32, h), "linear32"), ("final_layer.audio_out.bias", (32,), "bias32"),
    ]  # fmt: skip
    return specs


def kind_dtype(a, kind: str) -> torch.dtype:
    if kind in ("adaln", "adaln_bias"):  # ComfyUI keeps curve-form adaln in fp32
        return torch.float32 if a.adaln == "curve" else a.torch_dtype
    return a.torch_dtype if kind in ("linear", "bias", "norm") else torch.float32


def make_tensor(a, name: str, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    dt = a.torch_dtype
    adaln_dt = kind_dtype(a, "adaln")
    if kind in ("linear", "linear32"):
        return _randn(a.seed, name, shape, 1.0 / math.sqrt(shape[1]), dt if kind == "linear" else torch.float32)
    if kind in ("bias", "bias32"):
        return _randn(a.seed, name, shape, 0.02, dt if kind == "bias" else torch.float32)
    if kind == "norm":
        return (1.0 + _randn(a.seed, name, shape, 0.1, torch.float32)).to(dt)
    if kind == "rope":
        return 10000.0 ** (-torch.arange(shape[0], dtype=torch.float32) / shape[0])
    if kind == "table":
        return _randn(a.seed, name, shape, 1.0, torch.float32)
    if kind == "adaln":
        return _randn(a.seed, name, shape, 0.3 / math.sqrt(shape[1]), adaln_dt)
    if kind == "adaln_bias":  # rows: 3 modalities x [shift, scale, gate, shift, scale, gate] x hidden
        b = _randn(a.seed, name, shape, 0.05, torch.float32).view(3, 6, a.hidden)
        b[:, 2] += 1.0  # gate_msa
        b[:, 5] += 1.0  # gate_mlp
        return b.reshape(shape).to(adaln_dt)
    raise ValueError(kind)


def _quantised(name: str) -> bool:
    return (
        name.endswith(".weight") and name.startswith(("blocks.", "token_refiner.blocks.")) and name[: -len(".weight")].endswith(QUANTISED)
    )


def pending_tensors(a) -> list[PendingTensor]:
    marker = json.dumps({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": a.convrot_group}).encode()
    out: list[PendingTensor] = []
    for name, shape, kind in layer_specs(a):
        dtype = kind_dtype(a, kind)
        if not (a.int8 and _quantised(name)):
            out.append(PendingTensor(name, dtype, shape, lambda n=name, s=shape, k=kind: make_tensor(a, n, s, k)))
            continue
        layer = name[: -len(".weight")]
        cache: dict[str, torch.Tensor] = {}

        def quant(part: str, n=name, s=shape, k=kind, cache=cache) -> torch.Tensor:
            if not cache:
                cache.update(_quantise(a, n, s, k))
            return cache.pop(part)

        out += [
            PendingTensor(name, torch.int8, shape, lambda q=quant: q("weight")),
            PendingTensor(f"{layer}.weight_scale", torch.float32, (shape[0], 1), lambda q=quant: q("weight_scale")),
            PendingTensor(
                f"{layer}.comfy_quant", torch.uint8, (len(marker),), lambda: torch.frombuffer(bytearray(marker), dtype=torch.uint8)
            ),
        ]
    return out


def _quantise(a, name, shape, kind) -> dict[str, torch.Tensor]:
    if a.full_size:  # random int8 with the scale of a fan-in init: std(int8 uniform) ~ 73.3
        q = torch.randint(-127, 128, shape, generator=_gen(a.seed, name), dtype=torch.int8)
        return {"weight": q, "weight_scale": torch.full((shape[0], 1), 1.0 / (73.3 * math.sqrt(shape[1])))}
    from comfy_kitchen.tensor import QuantizedTensor

    w = make_tensor(a, name, shape, kind).float()
    qt = QuantizedTensor.from_float(
        w, "TensorWiseINT8Layout", is_weight=True, per_channel=True, convrot=True, convrot_groupsize=a.convrot_group
    )
    sd = qt.state_dict("w")
    return {"weight": sd["w"].contiguous(), "weight_scale": sd["w_scale"].float().reshape(shape[0], 1).contiguous()}


def write_conditioning(path: str, text_dim: int, tokens: int, seed: int) -> None:
    cond = torch.randn((1, tokens, text_dim), generator=_gen(seed, "cond"))
    tags = torch.ones(tokens, dtype=torch.int64)
    write_streaming(
        path,
        [
            PendingTensor("cond", cond.dtype, tuple(cond.shape), lambda: cond),
            PendingTensor("token_tags", tags.dtype, (tokens,), lambda: tags),
        ],
    )


def vae_specs() -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of ComfyUI's tiny video autoencoder (comfy/taesd/taehv.py; ComfyUI knows it by `decoder.22.bias`
    and sizes it by `decoder.1.weight`) for H3's 24 latent channels: 8x up in space, 4x in time, 11 M weights."""
    specs = []

    def conv(p: str, n_in: int, n_out: int, k: int = 3, bias: bool = True) -> None:
        specs.append((f"{p}.weight", (n_out, n_in, k, k)))
        specs.extend([(f"{p}.bias", (n_out,))] if bias else [])

    def memory_blocks(part: str, first: int, n: int) -> None:
        for i in range(first, first + 3):
            conv(f"{part}.{i}.conv.0", 2 * n, n), conv(f"{part}.{i}.conv.2", n, n), conv(f"{part}.{i}.conv.4", n, n)

    conv("encoder.0", 3, 64)
    for i, time_pool in ((2, 2), (7, 2), (12, 1)):  # a time pool, a 2x down conv, three memory blocks
        conv(f"encoder.{i}.conv", 64 * time_pool, 64, 1, bias=False), conv(f"encoder.{i + 1}", 64, 64, bias=False)
        memory_blocks("encoder", i + 2, 64)
    conv("encoder.17", 64, 24)
    conv("decoder.1", 24, 256)
    for i, (n, n_out, time_grow) in zip((3, 9, 15), ((256, 128, 1), (128, 64, 2), (64, 64, 2))):
        memory_blocks("decoder", i, n)  # then a 2x upsample, a time grow, a conv
        conv(f"decoder.{i + 4}.conv", n, n * time_grow, 1, bias=False), conv(f"decoder.{i + 5}", n, n_out, bias=False)
    conv("decoder.22", 64, 3)
    return specs


def write_vae(path: str, seed: int) -> None:
    """Random weights, fan-in scaled for ReLU, a memory block's last conv and the output conv small: frames of coloured
    blobs around mid-grey (pixel std ~0.12), not saturated."""

    def make(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name == "decoder.22.bias":
            return torch.full(shape, 0.5, dtype=torch.bfloat16)
        gain = 0.05 if name == "decoder.22.weight" else 0.2 if name.endswith("conv.4.weight") else 2**0.5
        std = gain / math.prod(shape[1:]) ** 0.5 if len(shape) > 1 else 0.02
        return _randn(seed, name, shape, std, torch.bfloat16)

    write_streaming(path, [PendingTensor(n, torch.bfloat16, s, lambda n=n, s=s: make(n, s)) for n, s in vae_specs()])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help="output .safetensors (checkpoint mode)")
    ap.add_argument("--conditioning", metavar="OUT", help="write a conditioning file instead of a checkpoint")
    ap.add_argument("--vae", metavar="OUT", help="write a small video VAE for the tiny model's latents instead")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--int8", action="store_true", help="int8 ConvRot quantised big linears")
    ap.add_argument("--full-size", action="store_true", help="the real H3 dims (50 blocks, ~20 GB int8)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--refiner-layers", type=int, default=1)
    ap.add_argument("--text-dim", type=int, default=128)
    ap.add_argument("--time-embed-dim", type=int, help="adaln input width (default: 8 curve, hidden/2 full)")
    ap.add_argument("--curve-grid", type=int, default=33)
    ap.add_argument("--adaln", choices=("curve", "full"), default="curve", help="curve (int8 release) or full form")
    ap.add_argument("--convrot-group", type=int, default=256, help="ConvRot group (power of 4)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), help="dtype of non-fp32-island tensors (default fp32 tiny, bf16 full)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout-only", action="store_true", help="write the names/dtypes/shapes as JSON, no weights")
    a = ap.parse_args(argv)
    if a.full_size:
        for k, v in FULL_SIZE.items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    if a.time_embed_dim is None:
        a.time_embed_dim = 8 if a.adaln == "curve" else a.hidden // 2
    a.torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype or ("bf16" if a.full_size else "fp32")]
    if not (a.conditioning or a.vae) and a.text_dim == a.hidden:
        ap.error(f"--text-dim ({a.text_dim}) must differ from --hidden: H3 treats a context of hidden width as already refined")
    if not (a.conditioning or a.vae or a.out):
        ap.error("give OUT.safetensors, --conditioning OUT.safetensors or --vae OUT.safetensors")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.conditioning:
        write_conditioning(a.conditioning, a.text_dim, a.tokens, a.seed)
        print(f"{a.conditioning}: cond [1, {a.tokens}, {a.text_dim}], token_tags [{a.tokens}]")
        return 0
    if a.vae:
        os.makedirs(os.path.dirname(os.path.abspath(a.vae)), exist_ok=True)
        write_vae(a.vae, a.seed)
        print(f"{a.vae}: a small video VAE, {os.path.getsize(a.vae) / 1e6:.1f} MB")
        return 0
    tensors = pending_tensors(a)
    if a.layout_only:
        marker = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": a.convrot_group}
        doc = {
            "source": os.path.basename(a.out),
            "metadata": {},
            "quant": {t.name[: -len(".comfy_quant")]: marker for t in tensors if t.name.endswith(".comfy_quant")},
            "tensors": {t.name: [DTYPE_CODES[t.dtype], list(t.shape)] for t in tensors},
        }
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=0, sort_keys=True)
        print(f"{a.out}: layout of {len(tensors)} tensors")
        return 0

    def progress(i: int, n: int) -> None:
        if a.full_size and (i == n or i % 50 == 0):
            print(f"\r  {i}/{n} tensors", end="" if i < n else "\n", file=sys.stderr, flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    write_streaming(a.out, tensors, None, progress)
    size = os.path.getsize(a.out)
    print(f"{a.out}: {len(tensors)} tensors, {size / 1e6:.1f} MB, hidden {a.hidden}, {a.heads}x{a.head_dim} heads, ffn {a.ffn}, "
          f"{a.layers} blocks + {a.refiner_layers} refiner, adaln {a.adaln}, {'int8 ConvRot' if a.int8 else str(a.torch_dtype)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
