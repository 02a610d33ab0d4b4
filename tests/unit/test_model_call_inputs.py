"""What rank 0 hands every rank at each model call (nodes/model_wrappers.py uses tp2.collectives.carries_tensors)."""

from __future__ import annotations

import torch

from tp2.collectives import carries_tensors


def test_every_tensor_input_of_a_model_call_is_carried():
    """What rank 0 broadcasts at each model call: any keyword input holding a tensor at any depth (the newest upstream
    H3 forward takes denoise_mask and audio_denoise_mask; others pass lists of latents), never plain flags."""
    t = torch.zeros(1)
    kwargs = {
        "denoise_mask": t,
        "audio_denoise_mask": t,
        "ref_latents": [t],
        "nested": {"a": (1, t)},
        "flag": True,
        "name": "x",
        "none": None,
    }
    assert [k for k, v in kwargs.items() if carries_tensors(v)] == ["denoise_mask", "audio_denoise_mask", "ref_latents", "nested"]
