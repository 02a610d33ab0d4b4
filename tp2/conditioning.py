"""Conditioning files: `cond` [1, L, text_dim] float and optional `token_tags` [L] int64 (1 = text, 0 = pad).

Lets H3 workflows run without the 32B text encoder (tests, demos, an encoding made once and reused):
`save_conditioning` writes what `load_conditioning` reads.
"""

from __future__ import annotations

import torch

from .errors import TP2Error
from .safetensors_io import PendingTensor, TensorReader, write_streaming


def load_conditioning(path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    with TensorReader(path) as r:
        names = set(r.header.tensors)
        if "cond" not in names:
            raise TP2Error(
                f"'{path}' has no 'cond' tensor (it has {sorted(names)}). Write one with scripts/make_tiny_h3.py --conditioning."
            )
        cond = r.read("cond")
        tags = r.read("token_tags").long() if "token_tags" in names else None
    if cond.dim() != 3 or cond.shape[0] != 1:
        raise TP2Error(f"'cond' in '{path}' has shape {list(cond.shape)}; it must be [1, L, text_dim].")
    if tags is not None and tags.shape != (cond.shape[1],):
        raise TP2Error(f"'token_tags' in '{path}' has shape {list(tags.shape)}; it must be [{cond.shape[1]}] (one tag per token).")
    return cond, tags


def save_conditioning(path: str, cond: torch.Tensor, tags: torch.Tensor | None = None) -> None:
    if cond.dim() != 3 or cond.shape[0] != 1:
        raise TP2Error(f"Conditioning of shape {list(cond.shape)} cannot be saved: it must be [1, L, text_dim] (one prompt).")
    tensors = {"cond": cond.detach().cpu().contiguous()}
    if tags is not None:
        tensors["token_tags"] = tags.detach().cpu().long().reshape(-1).contiguous()
    write_streaming(path, [PendingTensor(n, t.dtype, tuple(t.shape), lambda t=t: t) for n, t in tensors.items()])
