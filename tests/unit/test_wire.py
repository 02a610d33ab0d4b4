"""tp2/wire.py's int8 wire and kernels/wire_codec.py's kernels (on CPU through Triton's interpreter), and the
launcher's choice of wire (tp2/link.py): the bytes a rank sends, the sum every rank makes of them, who may use it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts", "lib"))

from link_settings import pick_wire  # noqa: E402

from tp2 import wire  # noqa: E402
from tp2.link import NO_P2P  # noqa: E402
from tp2.settings import SettingError, read_tp_env  # noqa: E402


def _quantized(x: torch.Tensor, codec=wire.TORCH):
    q, s = torch.empty(x.shape, dtype=torch.int8), torch.empty((x.shape[0], x.shape[1] // wire.GROUP), dtype=torch.bfloat16)
    codec.quantize(x, q, s)
    return q, s


def _stacked(parts):
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def test_a_row_comes_back_within_half_a_step_of_its_group():
    x = torch.randn(5, 256) * torch.logspace(-3, 3, 5).unsqueeze(1)  # rows of very different size
    x[2, :64] = 0  # a group of zeros: scale 0, values 0
    q, s = _quantized(x)
    y = wire.dequant_sum(q.unsqueeze(0), s.unsqueeze(0), torch.float32)
    assert ((y - x).abs() <= s.float().repeat_interleave(wire.GROUP, 1) / 2 * 1.01 + 1e-30).all()
    assert not y[2, :64].any() and (y.abs().amax(1) > 0).all()


def test_the_sum_is_the_same_for_chunks_of_rows_and_near_the_exact_sum():
    x = torch.randn(2, 600, 512)
    whole = wire.dequant_sum(*_stacked([_quantized(t) for t in x]), torch.bfloat16)
    assert torch.equal(wire.sum_here(list(x), wire.INT8).to(torch.bfloat16), whole)  # what every rank makes of the same bytes
    chunked = torch.cat([wire.sum_here([t[:7] for t in x], wire.INT8), wire.sum_here([t[7:] for t in x], wire.INT8)])
    assert torch.equal(chunked, wire.sum_here(list(x), wire.INT8))  # a group never crosses a row
    exact, got = x[0] + x[1], wire.sum_here(list(x), wire.INT8)
    assert 40 < 10 * torch.log10(exact.pow(2).sum() / (exact - got).pow(2).sum()) < 50  # ~44.5 dB for Gaussian rows
    assert torch.equal(wire.sum_here(list(x), wire.EXACT), exact)


def test_the_compressed_wire_is_refused_beyond_two_ranks():
    env = {"TP2_RANK": "0", "TP2_WORLD_SIZE": "2", "TP2_WIRE": "int8"}
    assert read_tp_env(env).tp_size == 2 and read_tp_env(dict(env, TP2_WORLD_SIZE="4", TP2_WIRE="exact")).tp_size == 4
    with pytest.raises(SettingError, match=r"TP2_WIRE=int8 needs exactly 2 ranks \(TP2_WORLD_SIZE=4\)"):
        read_tp_env(dict(env, TP2_WORLD_SIZE="4"))


def test_the_launcher_picks_exact_on_nvlink_and_int8_through_pcie_or_host_memory():
    assert pick_wire("NVLink (NV4)", 2) == "exact" and pick_wire("one GPU (ranks share it)", 2) == "exact"
    assert pick_wire("PCIe peer-to-peer (PHB)", 2) == "int8" and pick_wire(NO_P2P, 2) == "int8"
    assert pick_wire(NO_P2P, 4) == "exact"  # one-shot: no fewer bytes at four ranks


def test_the_fused_kernels_match_torch_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "fused_check"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]


def fused_check() -> None:
    """The fused sum gives torch's bytes from the same quantised bytes (rank order, a partial tile); the fused quantiser
    lands within one step of torch's (the interpreter rounds bf16 scales its own way)."""
    from kernels import wire_codec

    codec = wire_codec.select(torch.device("cpu"))
    assert codec is not None
    x = torch.randn(2, 3, 1088) * 10  # 1088: a whole tile and a partial one
    parts = [_quantized(t) for t in x]
    for dtype in (torch.float32, torch.float16):
        assert torch.equal(codec.dequant_sum(*_stacked(parts), dtype), wire.dequant_sum(*_stacked(parts), dtype)), dtype
    q, s = _quantized(x[0], codec)
    assert torch.allclose(s.float(), parts[0][1].float(), rtol=1e-2)
    y, ref = (wire.dequant_sum(a.unsqueeze(0), b.unsqueeze(0), torch.float32) for a, b in ((q, s), parts[0]))
    assert ((y - ref).abs() <= s.float().repeat_interleave(wire.GROUP, 1) * 1.02).all()


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
