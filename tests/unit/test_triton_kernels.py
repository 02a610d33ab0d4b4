"""The Triton kernels (kernels/qk_norm_rope.py, kernels/norm_modulate.py) on CPU, through Triton's interpreter.

Each check runs in a fresh Python process with TRITON_INTERPRET=1 (set before triton is imported, as the
interpreter needs), where the kernels' @triton.jit functions run on CPU tensors with numpy. What this checks is
the indexing and the arithmetic (which element goes where, which weights and rotation entries meet which values,
the norm-only tail, masked edges); the GPU tests check the roundings against comfy-kitchen's CUDA kernel and
float64. The references below are written out from comfy-kitchen's kernel and ComfyUI's ops, in fp32 with the
same roundings. fp16 and fp32 only: the interpreter's bf16 conversion does not round to nearest even.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def in_interpreter(check: str, *args) -> None:
    """Run `check(*args)` of this file in a fresh process under Triton's interpreter; fail with its output."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, os.path.abspath(__file__), check, *map(str, args)], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, f"{check}{args} under the Triton interpreter:\n{res.stdout}\n{res.stderr[-4000:]}"


def _kernels(name: str):
    sys.path.insert(0, ROOT)
    import importlib

    return importlib.import_module(f"kernels.{name}")


def rotation_table(s: int, pairs: int, dtype) -> torch.Tensor:
    """H3's [1, S, 1, P, 2, 2] table (ComfyUI's rope_rotation_table), from random angles."""
    angles = torch.rand(s, pairs) * 6.28
    c, sn = torch.cos(angles), torch.sin(angles)
    return torch.stack([c, -sn, sn, c], dim=-1).reshape(1, s, 1, pairs, 2, 2).to(dtype)


def rms_rope_reference(x: torch.Tensor, table: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """comfy-kitchen's rms_rope split-half kernel, written out: fp32 math, rounded after the norm and the rotation."""
    pairs = table.shape[3]
    xf = x.float()
    rrms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = (xf * rrms * w.float()).to(x.dtype).float()
    f = table[0, :, 0].float()[:, None]  # [S, 1, P, 2, 2]
    lo, hi = n[..., :pairs], n[..., pairs : 2 * pairs]
    rotated = (f[..., 0, 0] * lo + f[..., 0, 1] * hi, f[..., 1, 0] * lo + f[..., 1, 1] * hi)
    return torch.cat([*(r.to(x.dtype) for r in rotated), n[..., 2 * pairs :].to(x.dtype)], dim=-1)


def check_qk_norm_rope(dtype: str, s: str, heads: str, d: str, pairs: str) -> None:
    kernel = _kernels("qk_norm_rope")
    dtype, s, heads, d, pairs = getattr(torch, dtype), int(s), int(heads), int(d), int(pairs)
    torch.manual_seed(s + heads)
    qkv = (torch.randn(s, 3 * heads * d) * 3).to(dtype)
    q, k, v = (t.view(s, heads, d) for t in qkv.split(heads * d, dim=-1))
    v_before = v.clone()
    table = rotation_table(s, pairs, dtype)
    qw, kw = (torch.rand(d) + 0.5).to(dtype), (torch.rand(d) + 0.5).to(dtype)
    want_q, want_k = rms_rope_reference(q, table, qw, 1e-6), rms_rope_reference(k, table, kw, 1e-6)
    assert kernel.available(q, k, table)
    kernel.rms_rope_split_half_(q, k, table, qw, kw, 1e-6)
    assert torch.equal(v, v_before), "v's columns of the qkv buffer changed"
    for got, want in ((q, want_q), (k, want_k)):
        if dtype == torch.float16:  # rsqrt and fp32 sums in another order: a rare last-place flip
            ulp = (got.float() - want.float()).abs() / want.float().abs().clamp_min(6e-5)
            assert (ulp > 2e-3).sum() == 0 and (got != want).float().mean() < 1e-3, (got - want).abs().max()
        else:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    q = torch.randn(8, 2, 64)
    assert not kernel.available(q, q, rotation_table(8, 40, q.dtype)), "2P > head_dim"
    assert not kernel.available(q, q, rotation_table(7, 16, q.dtype)), "another sequence length"
    assert not kernel.available(q.transpose(0, 1), q.transpose(0, 1), rotation_table(2, 16, q.dtype)), "heads not contiguous"


def check_norm_modulate(gated: str) -> None:
    kernel = _kernels("norm_modulate")
    gated = gated == "True"
    torch.manual_seed(1)
    rows, d = 9, 96
    x, y = torch.randn(rows, d), torch.randn(rows, d)
    gate, scale, shift, w = (torch.randn(d) * 0.3 for _ in range(4))
    expected_x = x + gate * y if gated else x.clone()
    expected_h = torch.nn.functional.rms_norm(expected_x, (d,), w, 1e-6) * (1 + scale) + shift
    h = torch.empty_like(x)
    assert kernel.available(x.device, x.dtype)
    if gated:
        kernel.norm_modulate(x, w, 1e-6, 1 + scale, shift, h, gate, y)
    else:
        kernel.norm_modulate(x, w, 1e-6, 1 + scale, shift, h)
    torch.testing.assert_close(x, expected_x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h, expected_h, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("shape", [(37, 3, 128, 48), (5, 2, 64, 32), (16, 1, 64, 24)], ids=["h3_head", "full_rotation", "odd_pairs"])
def test_qk_norm_rope_in_place_in_a_qkv_buffer(dtype, shape):
    """[S, H, D] q/k views of a qkv buffer: H3's head (D 128, rot 96: a 32-wide tail), a fully rotated head, and a
    pair count that is not a power of two."""
    in_interpreter("check_qk_norm_rope", dtype, *shape)


@pytest.mark.parametrize("gated", [False, True])
def test_norm_modulate_matches_comfy_ops_in_fp32(gated):
    in_interpreter("check_norm_modulate", gated)


def test_a_kernel_that_does_not_run_is_reported_once_and_not_used(caplog, monkeypatch):
    """kernels.triton_probe: a failing probe (a GPU or dtype Triton cannot compile for) answers False, says why
    once, and is not retried; a working one answers True. (CPU counts as a Triton device under the interpreter.)"""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sys.path.insert(0, ROOT)
    from kernels import triton_probe

    calls = []

    def broken(device, dtype):
        calls.append(dtype)
        raise RuntimeError("no bf16 on this GPU\nmore detail")

    cpu = torch.device("cpu")
    with caplog.at_level("WARNING"):
        assert not triton_probe.runs("test_broken", cpu, torch.bfloat16, broken)
        assert not triton_probe.runs("test_broken", cpu, torch.bfloat16, broken)
    assert calls == [torch.bfloat16] and "test_broken does not run on cpu in torch.bfloat16 (no bf16 on this GPU)" in caplog.text
    assert triton_probe.runs("test_working", cpu, torch.float16, lambda device, dtype: None)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
