"""tp2/wire.py's formats and kernels/wire_codec.py's kernels (on CPU through Triton's interpreter), and the
launcher's choice of wire (tp2/link.py): the bytes a rank sends, the sum every rank makes of them, who may use it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tp2 import wire  # noqa: E402
from tp2.link import NO_P2P, pick_wire  # noqa: E402
from tp2.settings import SettingError  # noqa: E402


def _quantized(x: torch.Tensor, fmt, codec=wire.TORCH):
    m, n = x.shape
    q = torch.empty((m, n // fmt.per_byte), dtype=torch.uint8)
    s = torch.empty((m, n // fmt.group), dtype=torch.bfloat16)
    codec.quantize(x, fmt, q, s)
    return q, s


@pytest.mark.parametrize("name", list(wire.FORMATS))
def test_a_row_comes_back_within_half_a_step_of_its_group(name):
    fmt = wire.FORMATS[name]
    x = torch.randn(5, 256) * torch.logspace(-3, 3, 5).unsqueeze(1)  # rows of very different size
    x[2, :64] = 0  # a group of zeros: scale 0, values 0
    q, s = _quantized(x, fmt)
    y = wire.dequant_sum(q.unsqueeze(0), s.unsqueeze(0), fmt, torch.float32)
    step = s.float().repeat_interleave(fmt.group, 1)
    assert ((y - x).abs() <= step / 2 * 1.01 + 1e-30).all()
    assert not y[2, :64].any() and (y.abs().amax(1) > 0).all()


@pytest.mark.parametrize("name", list(wire.FORMATS))
def test_the_sum_is_in_rank_order_and_the_same_for_chunks_of_rows(name):
    fmt, x = wire.FORMATS[name], torch.randn(2, 6, 128)
    parts = [_quantized(t, fmt) for t in x]
    qs, ss = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    whole = wire.dequant_sum(qs, ss, fmt, torch.bfloat16)
    each = [wire.dequant_sum(qs[:, r : r + 1], ss[:, r : r + 1], fmt, torch.bfloat16) for r in range(6)]
    assert torch.equal(torch.cat(each), whole)  # rows are independent
    assert torch.equal(wire.sum_here(list(x), name).to(torch.bfloat16), whole)  # what every rank makes of the same bytes
    chunked = torch.cat([wire.sum_here([t[:3] for t in x], name), wire.sum_here([t[3:] for t in x], name)])
    assert torch.equal(chunked, wire.sum_here(list(x), name))


def test_compressed_wires_are_refused_beyond_two_ranks():
    assert wire.wire_for("int8", 2) == "int8" and wire.wire_for("exact", 4) == "exact"
    with pytest.raises(SettingError, match="TP2_WIRE=int4 needs exactly 2 ranks"):
        wire.wire_for("int4", 4)


def test_the_launcher_picks_exact_on_nvlink_and_int8_through_pcie_or_host_memory():
    assert pick_wire("NVLink (NV4)", 2) == "exact" and pick_wire("one GPU (ranks share it)", 2) == "exact"
    assert pick_wire("PCIe peer-to-peer (PHB)", 2) == "int8" and pick_wire(NO_P2P, 2) == "int8"
    assert pick_wire(NO_P2P, 4) == "exact"  # one-shot: no fewer bytes at four ranks
    assert pick_wire(NO_P2P, 2, {"exact": 1.80, "int8": 1.90}) == "exact"  # within 10%: the exact one
    assert pick_wire("NVLink (NV4)", 2, {"exact": 1.10, "int8": 1.70}) == "int8"  # the figures win over the kind


def test_the_fused_kernels_match_torch_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "fused_check"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]


def fused_check() -> None:
    """The fused sum gives torch's bytes from the same quantised bytes (rank order, tile edges, int4 nibbles); the fused
    quantiser is within one step of torch's (the interpreter rounds bf16 scales its own way)."""
    from kernels import wire_codec

    codec = wire_codec.select(torch.device("cpu"), wire.FORMATS.values())
    assert codec is not None
    for fmt in wire.FORMATS.values():
        x = torch.randn(2, 3, 1088) * 10  # 1088: a whole tile and a partial one
        parts = [_quantized(t, fmt) for t in x]
        qs, ss = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        for dtype in (torch.float32, torch.float16):
            assert torch.equal(codec.dequant_sum(qs, ss, fmt, dtype), wire.dequant_sum(qs, ss, fmt, dtype)), (fmt, dtype)
        q, s = _quantized(x[0], fmt, codec)
        assert torch.allclose(s.float(), parts[0][1].float(), rtol=1e-2)
        y, ref = (wire.dequant_sum(a.unsqueeze(0), b.unsqueeze(0), fmt, torch.float32) for a, b in ((q, s), parts[0]))
        assert ((y - ref).abs() <= s.float().repeat_interleave(fmt.group, 1) * 1.02).all(), fmt


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
