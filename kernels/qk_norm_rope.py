"""Per-head RMSNorm + partial split-half rope of H3's q and k, in place in the qkv buffer (Triton).

Stands in for comfy-kitchen's `rms_rope_split_half_` in ComfyUI's H3 attention: the same arithmetic on a block of
tokens for every head, the rotation table loaded once per block:

    n = round(x * rrms * w)                 rrms = rsqrt(mean(x^2) + eps) over the whole head (fp32)
    out[i]        = round(f00 * n[i] + f01 * n[i + P])     for i < P (P = rot_dim / 2)
    out[i + P]    = round(f10 * n[i] + f11 * n[i + P])
    out[2P:]      = n[2P:]                  (the head dims past rot_dim are normalised, not rotated)

Roundings as comfy-kitchen's (to the activation dtype after the norm and after the rotation). q and k are [S, H, D]
views with contiguous heads; the table is H3's [1, S, 1, P, 2, 2] rotation table. `available(...)` says whether it
can run; callers keep comfy-kitchen otherwise.
"""

from __future__ import annotations

import torch

from . import triton_probe
from .triton_probe import tl, triton

TOKENS_PER_PROGRAM = 16


def available(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor) -> bool:
    """Whether this kernel can take the call: CUDA where it really runs for this dtype (probed once; Triton's
    interpreter on CPU), floating q/k views [S, H, D] with contiguous heads, a [1, S, 1, P, 2, 2] table, 2P <= D."""
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype or q.shape != k.shape or q.dim() != 3:
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1 or q.stride(1) != q.shape[2] or k.stride(1) != k.shape[2]:
        return False
    s, _, d = q.shape
    if not (table.dim() == 6 and tuple(table.shape[:3]) == (1, s, 1) and tuple(table.shape[4:]) == (2, 2) and 2 * table.shape[3] <= d):
        return False
    return triton_probe.runs("qk_norm_rope", q.device, q.dtype, _probe)


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    x = torch.ones((2, 1, 128), device=device, dtype=dtype)
    table = torch.ones((1, 2, 1, 48, 2, 2), device=device, dtype=dtype)
    rms_rope_split_half_(x, x.clone(), table, x[0, 0], x[0, 0], 1e-6)


if triton is not None:

    @triton.jit
    def _head(base, w_ptr, f00, f01, f10, f11, p, pmask, c, cmask, eps, D: tl.constexpr, P: tl.constexpr, TAIL: tl.constexpr):
        """One head of T tokens, in place: norm over D, rotate the first 2P dims, normalise the tail."""
        dt = base.dtype.element_ty
        lo = tl.load(base + p, mask=pmask, other=0.0).to(tl.float32)
        hi = tl.load(base + P + p, mask=pmask, other=0.0).to(tl.float32)
        sq_sum = tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)
        if TAIL > 0:
            tail = tl.load(base + 2 * P + c, mask=cmask, other=0.0).to(tl.float32)
            sq_sum += tl.sum(tail * tail, axis=1)
        rrms = tl.math.rsqrt(sq_sum / D + eps)[:, None]
        n0 = (lo * rrms * tl.load(w_ptr + p, mask=p < P, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        n1 = (hi * rrms * tl.load(w_ptr + P + p, mask=p < P, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(base + p, (f00 * n0 + f01 * n1).to(dt), mask=pmask)
        tl.store(base + P + p, (f10 * n0 + f11 * n1).to(dt), mask=pmask)
        if TAIL > 0:
            wt = tl.load(w_ptr + 2 * P + c, mask=c < TAIL, other=0.0).to(tl.float32)
            tl.store(base + 2 * P + c, (tail * rrms * wt).to(dt), mask=cmask)

    @triton.jit
    def _kernel(
        q_ptr, k_ptr, f_ptr, qw_ptr, kw_ptr, s, heads, sq, sk, ft, fp, eps,
        D: tl.constexpr, P: tl.constexpr, PB: tl.constexpr, TAIL: tl.constexpr, TB: tl.constexpr, T: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64) * T + tl.arange(0, T)[:, None]
        tmask = t < s
        p = tl.arange(0, PB)[None, :]
        pmask = tmask & (p < P)
        f = f_ptr + t * ft + p * fp  # the rotation of pair p of token t: [[f00, f01], [f10, f11]]
        f00 = tl.load(f, mask=pmask, other=0.0).to(tl.float32)
        f01 = tl.load(f + 1, mask=pmask, other=0.0).to(tl.float32)
        f10 = tl.load(f + 2, mask=pmask, other=0.0).to(tl.float32)
        f11 = tl.load(f + 3, mask=pmask, other=0.0).to(tl.float32)
        c = tl.arange(0, TB)[None, :]
        cmask = tmask & (c < TAIL)
        for h in range(heads):
            _head(q_ptr + t * sq + h * D, qw_ptr, f00, f01, f10, f11, p, pmask, c, cmask, eps, D, P, TAIL)
            _head(k_ptr + t * sk + h * D, kw_ptr, f00, f01, f10, f11, p, pmask, c, cmask, eps, D, P, TAIL)


def rms_rope_split_half_(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, qw: torch.Tensor, kw: torch.Tensor, eps: float) -> None:
    """In place on q and k ([S, H, D] views, contiguous heads): per-head RMSNorm with weights qw / kw, then the
    split-half rotation of the first 2P dims by `table` ([1, S, 1, P, 2, 2]). Check `available` first."""
    s, heads, d = q.shape
    pairs = table.shape[3]
    if s == 0:
        return
    if table.stride(4) != 2 or table.stride(5) != 1:  # the kernel reads each 2x2 rotation as 4 adjacent values
        table = table.contiguous()
    qw, kw = qw.to(device=q.device).contiguous(), kw.to(device=q.device).contiguous()
    tail = d - 2 * pairs
    _kernel[(triton.cdiv(s, TOKENS_PER_PROGRAM),)](
        q, k, table, qw, kw, s, heads, q.stride(0), k.stride(0), table.stride(1), table.stride(3), float(eps),
        D=d, P=pairs, PB=triton.next_power_of_2(pairs), TAIL=tail, TB=triton.next_power_of_2(max(tail, 1)),
        T=TOKENS_PER_PROGRAM, num_warps=4,
    )  # fmt: skip
