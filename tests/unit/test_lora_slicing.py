"""tp2.lora: slicing a LoRA's factors gives each rank exactly its shard of the full update, for every plan style."""

from __future__ import annotations

import pytest
import torch
from conftest import unshard_tensor

from tp2.errors import AdapterPlacementError
from tp2.lora import slice_like_weight, slice_lora_factors, state_dict_digest
from tp2.plan import RANK0, SPLIT, WHOLE, TensorShard
from tp2.shard import slice_tensor
from tp2.split import cut

OUT, IN, R = 24, 16, 3


def shard(kind, dim=None, parts=1, shape=(OUT, IN), shares=(1, 1)):
    bounds = cut(shape[dim] // parts, 1, shares) if kind == SPLIT else None
    return TensorShard("blocks.0.x.weight", kind, dim, parts, shape, "F32", "test", bounds)


@pytest.mark.parametrize("shares", [(1, 1), (1, 1, 1, 1), (3, 1)], ids=str)
@pytest.mark.parametrize("how", [(SPLIT, 0, 3), (SPLIT, 0, 2), (SPLIT, 0, 1), (SPLIT, 1, 1), (WHOLE,)], ids=str)
def test_factor_slices_make_the_weight_slice(how, shares):
    ts = shard(*how, shares=shares)
    up, down = torch.randn(OUT, R), torch.randn(R, IN)
    full = up @ down
    pieces = []
    for rank in range(len(shares)):
        u, d = slice_lora_factors(up, down, ts, rank, "k")
        assert torch.allclose(u @ d, slice_tensor(full, ts, rank), atol=1e-6)
        pieces.append(u @ d)
    if ts.kind == SPLIT:
        assert torch.allclose(unshard_tensor(pieces, ts), full, atol=1e-6)


def test_packed_parts_are_not_a_plain_split():
    """qkv packed: rank 0 gets the first half of q, k and v, not the first half of the fused rows."""
    up, down = torch.randn(OUT, R), torch.randn(R, IN)
    u, _ = slice_lora_factors(up, down, shard(SPLIT, 0, 3), 0, "k")
    assert torch.equal(u, torch.cat([up[0:4], up[8:12], up[16:20]]))


def test_wrong_shapes_refused_with_the_key():
    with pytest.raises(AdapterPlacementError, match="blocks.0.attn.qkv_proj.weight: LoRA up \\[24, 3\\] @ down \\[3, 8\\]"):
        slice_lora_factors(torch.randn(OUT, R), torch.randn(R, 8), shard(SPLIT, 0, 3), 0, "blocks.0.attn.qkv_proj.weight")


def test_full_size_diff_and_rank0_bias():
    diff = torch.randn(OUT, IN)
    assert torch.equal(slice_like_weight(diff, shard(SPLIT, 1), 1, "k"), diff[:, 8:])
    bias, ts = torch.randn(OUT), shard(RANK0, shape=(OUT,))
    assert torch.equal(slice_like_weight(bias, ts, 0, "k"), bias)
    assert not slice_like_weight(bias, ts, 1, "k").any()
    with pytest.raises(AdapterPlacementError, match="does not match the weight's full shape"):
        slice_like_weight(torch.randn(OUT, IN + 1), shard(SPLIT, 1), 0, "k")


def test_digest_sees_content_names_and_dtypes():
    sd = {"a.lora_A.weight": torch.ones(2, 3), "a.alpha": torch.tensor(2.0)}
    same = {k: v.clone() for k, v in sd.items()}
    assert state_dict_digest(sd) == state_dict_digest(same)
    changed = dict(same, **{"a.lora_A.weight": torch.ones(2, 3).index_fill_(1, torch.tensor([2]), 1.5)})
    assert state_dict_digest(changed) != state_dict_digest(sd)
    assert state_dict_digest({"b.lora_A.weight": sd["a.lora_A.weight"], "a.alpha": sd["a.alpha"]}) != state_dict_digest(sd)
    assert state_dict_digest(dict(sd, **{"a.alpha": torch.tensor(2.0, dtype=torch.bfloat16)})) != state_dict_digest(sd)


def test_unmatched_warning_counts_the_layers_a_lora_names():
    from tp2.lora import unmatched_warning

    keys = [f"diffusion_model.blocks.{i}.attn.qkv_proj.{f}.weight" for i in range(4) for f in ("lora_A", "lora_B")] + ["x.alpha"]
    assert unmatched_warning(keys, 4) is None
    assert "matched 3 of its 4 layers; the other 1 are not in this model" in unmatched_warning(keys, 3)
    assert "patched nothing of the model (0 of its 4 layers matched)" in unmatched_warning(keys, 0)
