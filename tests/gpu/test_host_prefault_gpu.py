"""On the GPU machine only (`-m gpu`): the page-in thread of tp2/host_prefault.py beside real copies from the GPU
into a fresh host buffer, written in the order the H3 decode writes (frame slabs, front to back) and in the
opposite order: the buffer holds exactly what the GPU held, and the thread mapped the whole buffer."""

from __future__ import annotations

import pytest
import torch

from tp2.host_prefault import populated_ahead

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("order", ["front to back", "back to front"])
def test_copies_from_the_gpu_land_whole_beside_the_thread(order):
    frames, h, w = 124, 480, 832  # the bundled 832x480x124 video's float32 output: 594 MB
    src = torch.rand(1, 3, frames, h, w, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    out = torch.empty(src.shape)  # fresh host memory, as ComfyUI's VAE.decode allocates it
    starts = list(range(0, frames, 28))
    with populated_ahead(out, dim=2) as ahead:
        for s in starts if order == "front to back" else reversed(starts):
            out[:, :, s : s + 28].copy_(src[:, :, s : s + 28])
    if ahead.skipped:
        pytest.skip(f"this kernel cannot page in ahead: {ahead.skipped}")
    assert ahead.done and ahead.bytes == out.numel() * 4, str(ahead)
    assert torch.equal(out, src.cpu())
