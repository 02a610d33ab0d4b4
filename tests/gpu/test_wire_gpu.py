"""kernels/wire_codec.py on a GPU against tp2/wire.py's torch ops on the same device: the fused sum gives torch's bytes
from the same quantised bytes; the fused quantiser gives torch's scales and lands within one step of torch's values,
at H3's width (5376 columns: five whole tiles and a partial one)."""

from __future__ import annotations

import pytest
import torch

from tp2 import wire

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_codec_gives_torchs_sum_and_its_quantiser_within_a_step(dtype):
    from kernels import wire_codec

    dev = torch.device("cuda")
    codec = wire_codec.select(dev)
    assert codec is not None
    x = (torch.randn(2, 333, 5376, device=dev) * 30).to(dtype)
    qs = {c: torch.empty(x.shape, dtype=torch.int8, device=dev) for c in ("torch", "fused")}
    ss = {c: torch.empty((2, 333, 5376 // wire.GROUP), dtype=torch.bfloat16, device=dev) for c in ("torch", "fused")}
    for r in range(2):
        wire.TORCH.quantize(x[r], qs["torch"][r], ss["torch"][r])
        codec.quantize(x[r], qs["fused"][r], ss["fused"][r])
    assert torch.equal(ss["torch"], ss["fused"])  # the same bf16 scales (round to nearest even on a GPU)
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(codec.dequant_sum(qs["torch"], ss["torch"], out), wire.dequant_sum(qs["torch"], ss["torch"], out))
    assert (qs["fused"].int() - qs["torch"].int()).abs().max() <= 1
