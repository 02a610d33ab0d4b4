#!/usr/bin/env python3
"""A random LoRA for an H3 checkpoint (any size), for tests and demos of LoRA under tensor parallelism.

    python scripts/make_tiny_lora.py CHECKPOINT.safetensors OUT.safetensors [--rank 4] [--format diffusers|kohya]
        [--layers qkv_proj,out_proj,fc1,fc2,adaln] [--refiner] [--dora KEY] [--seed 0]

Shapes come from the checkpoint's header (int8 weights included), so the LoRA fits the file it is made for. The
update is strong on purpose: alpha = rank and factors scaled so that |up @ down| is about half of |W| (fan-in
scaled init), so a wrong slice on any rank moves the output by far more than numerical noise. `--dora KEY`
adds a DoRA magnitude to one layer (e.g. blocks.0.attn.qkv_proj), which the TP pack must refuse.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere
from tp2.checkpoint import CheckpointLayout, find_prefix  # noqa: E402

LAYER_SUFFIX = {"qkv_proj": "attn.qkv_proj", "out_proj": "attn.out_proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2", "adaln": "adaln_proj.linear"}


def _randn(seed: int, name: str, shape, std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little"))
    return torch.randn(*shape, generator=g) * std


def lora_targets(layout: CheckpointLayout, layers: list[str], refiner: bool) -> dict[str, tuple[int, int]]:
    """Layer name (no prefix) -> (out, in) for every block layer asked for."""
    prefix = find_prefix(layout)
    out = {}
    for name, (_dtype, shape) in layout.tensors.items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        layer = name[len(prefix) : -len(".weight")]
        in_blocks = layer.startswith("blocks.") or (refiner and layer.startswith("token_refiner.blocks."))
        if in_blocks and any(layer.endswith("." + LAYER_SUFFIX[k]) for k in layers):
            out[layer] = (shape[0], shape[1])
    return out


def make_lora(layout, layers, refiner, rank, fmt, seed, dora=None) -> dict[str, torch.Tensor]:
    sd = {}
    for layer, (n_out, n_in) in sorted(lora_targets(layout, layers, refiner).items()):
        r = min(rank, n_in, n_out)
        down = _randn(seed, layer + ".down", (r, n_in), n_in**-0.5)
        up = _randn(seed, layer + ".up", (n_out, r), 0.5 * r**-0.5)
        if fmt == "kohya":
            base = "lora_unet_" + layer.replace(".", "_")
            sd[base + ".lora_down.weight"], sd[base + ".lora_up.weight"] = down, up
        else:
            base = "diffusion_model." + layer
            sd[base + ".lora_A.weight"], sd[base + ".lora_B.weight"] = down, up
        sd[base + ".alpha"] = torch.tensor(float(r))
        if layer == dora:
            sd[base + ".dora_scale"] = torch.ones(n_out, 1)
    if dora is not None and not any(k.endswith(".dora_scale") for k in sd):
        raise SystemExit(f"--dora {dora}: no such LoRA layer")
    return sd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--format", choices=("diffusers", "kohya"), default="diffusers")
    ap.add_argument("--layers", default="qkv_proj,out_proj,fc1,fc2,adaln")
    ap.add_argument("--refiner", action="store_true", help="also the token refiner's blocks")
    ap.add_argument("--dora", metavar="LAYER", help="give this layer a DoRA magnitude (to test the refusal)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    layers = a.layers.split(",")
    unknown = sorted(set(layers) - set(LAYER_SUFFIX))
    if unknown:
        ap.error(f"unknown layers {unknown}; choose from {sorted(LAYER_SUFFIX)}")
    sd = make_lora(CheckpointLayout.from_file(a.checkpoint), layers, a.refiner, a.rank, a.format, a.seed, a.dora)
    save_file(sd, a.out, metadata={"generator": "minimax-h3-tp2 make_tiny_lora.py"})
    print(f"wrote {a.out}: {sum(k.endswith('.alpha') for k in sd)} layers, rank {a.rank}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
