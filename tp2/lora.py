"""LoRA under tensor parallelism: each rank's slice of a low-rank update, and a LoRA's identity.

A LoRA adds  dW = up @ down  (up [out, r], down [r, in]) to a weight W. When W is sharded the update must be
sharded exactly like it, and that is cheap to do on the factors instead of on dW:

    column-parallel (W split by output rows, per packed part)  ->  up split the same way, down whole
    row-parallel    (W split by input columns)                 ->  down split the same way, up whole
    replicated                                                  ->  both whole

Full-size updates (a "diff" or "set" tensor shaped like W) are sliced with the weight's own rule (a row-parallel
bias: rank 0 only, like the bias). The caller refuses what has no such slice (DoRA, LoHa/LoKr, conv, offsets).
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from .errors import AdapterPlacementError
from .plan import SPLIT, TensorShard
from .shard import slice_tensor


def slice_lora_factors(up: torch.Tensor, down: torch.Tensor, ts: TensorShard, tp_rank: int, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (up, down) for a weight sharded as `ts`; raises AdapterPlacementError on a shape mismatch."""
    full = tuple(ts.full_shape)
    if up.ndim != 2 or down.ndim != 2 or up.shape[1] != down.shape[0] or (up.shape[0], down.shape[1]) != full:
        raise AdapterPlacementError(
            f"{key}: LoRA up {list(up.shape)} @ down {list(down.shape)} does not make the weight's full shape {list(full)}: only "
            "2-D linear LoRAs made for this model (and H3 form) can be sliced. Without TP ComfyUI would skip this key; under TP "
            "it is refused so that no rank applies a wrong slice."
        )
    if ts.kind != SPLIT:
        return up, down
    if ts.dim == 0:
        return slice_tensor(up, dataclasses.replace(ts, full_shape=tuple(up.shape)), tp_rank), down
    return up, slice_tensor(down, dataclasses.replace(ts, full_shape=tuple(down.shape)), tp_rank)


def slice_like_weight(t: torch.Tensor, ts: TensorShard, tp_rank: int, key: str) -> torch.Tensor:
    """This rank's part of a tensor shaped like the full weight or bias (a "diff" or "set" patch)."""
    if tuple(t.shape) != tuple(ts.full_shape):
        raise AdapterPlacementError(
            f"{key}: a full-size patch of shape {list(t.shape)} does not match the weight's full shape {list(ts.full_shape)}."
        )
    return slice_tensor(t, ts, tp_rank)


def state_dict_digest(sd: dict[str, torch.Tensor]) -> str:
    """A content hash of a LoRA state dict (names, dtypes, shapes and bytes): the LoRA's identity across ranks."""
    h = hashlib.sha256()
    for name, t in sorted(sd.items()):
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# the key endings that name one patched layer in the LoRA formats ComfyUI loads (its up factor, or a full update)
LAYER_KEY_ENDS = (".lora_up.weight", ".lora_B.weight", "_lora.up.weight", ".lora.up.weight", ".lora_linear_layer.up.weight",
                  ".hada_w1_a", ".lokr_w1", ".lokr_w1_a", ".diff", ".set_weight")  # fmt: skip


def unmatched_warning(keys, matched: int) -> str | None:
    """What to tell the user when a LoRA of `keys` patched only `matched` weights; None when every layer it names did."""
    layers = sum(1 for k in keys if k.endswith(LAYER_KEY_ENDS))
    if matched == 0:
        return f"this LoRA patched nothing of the model (0 of its {layers} layers matched): it is not for MiniMax-H3, and the output equals no LoRA"
    if matched < layers:
        return f"this LoRA matched {matched} of its {layers} layers; the other {layers - matched} are not in this model and do nothing"
    return None
