"""The GPU numerics check: one small H3-shaped block through this rank's own kernels against exact math.

One block with random weights (fixed seed) runs through the rank's path (int8 ConvRot weights, every rank's column-
and row-parallel slices with partial sums in the reduce dtype, the rope, attention and norm kernels the rank will
use) and in fp32 with plain torch ops. The signal-to-quantisation-noise ratio (dB) of each part and of the block's
update must reach MIN_DB. The kernels are handed in (`BlockPath`): this never imports `comfy`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .layers import Int8Weight, apply_input_act, local_linear
from .split import Shares, even, small
from .wire import EXACT, sum_here

MIN_DB = 25.0
HEAD_DIM, LOCAL_HEADS, HIDDEN, LOCAL_FFN, TOKENS, ROPE_PAIRS, EPS = 128, 2, 512, 512, 128, 48, 1e-6
EXACT_DB = 99.0  # reported for results closer than this (fp32 paths are often exact)

# Settings that take each part off the path when it measures wrong.
AVOID = {
    "int8 GEMM": "TP2_INT8_KERNEL=triton with ComfyUI's --enable-triton-backend (or TP2_INT8_KERNEL=eager, slow), another comfy-kitchen build, or a bf16 checkpoint",
    "q/k norm + rope": "another comfy-kitchen build (or TP2_SP_FUSED_NORM=0 when it is on)",
    "attention": "TP2_ATTN_BACKEND=sdpa",
    "norm + modulation": "TP2_SP_FUSED_NORM=0",
}


@dataclass(frozen=True)
class BlockPath:
    """The calls this rank's H3 blocks make, as the pack resolved them on this device.

    gemm(x, qdata, scale, bias, out_dtype, convrot_group, input_act) -> y   (kernels.select_int8_gemm)
    quantize_weight(w [N, K] fp32, group) -> (qdata int8 [N, K], scale fp32 [N, 1])   int8 ConvRot, as checkpoints store it
    qk_norm_rope(q, k, table, q_w, k_w, eps)   in place on [S, H, D] views, table [1, S, 1, P, 2, 2]
    attention(q, k, v, heads) -> [1, S, H * D]   q, k, v: [1, H, S, D]
    norm_modulate(x, w, eps, scale1, shift) -> h, or None for plain ops
    """

    gemm: Callable[..., torch.Tensor]
    quantize_weight: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    qk_norm_rope: Callable[..., None]
    attention: Callable[..., torch.Tensor]
    norm_modulate: Callable[..., torch.Tensor] | None
    dtype: torch.dtype
    reduce_dtype: torch.dtype
    wire: str = EXACT  # TP2_WIRE: the row-parallel sums as every rank would make them
    names: dict[str, str] = field(default_factory=dict)  # part -> kernel name, for the report


@dataclass(frozen=True)
class NumericsReport:
    device: str
    parts_db: dict[str, float]
    names: dict[str, str]
    seconds: float

    @property
    def failing(self) -> list[str]:
        return [p for p, db in self.parts_db.items() if not db >= MIN_DB]  # NaN fails

    def summary(self) -> str:
        parts = ", ".join(f"{p} {db:.1f} dB" for p, db in self.parts_db.items())
        kernels = ", ".join(f"{p} {n}" for p, n in self.names.items())
        return f"{'FAILED' if self.failing else 'passed'} on {self.device} ({parts}; threshold {MIN_DB:.0f} dB; {kernels}; {self.seconds:.2f} s)"


def sqnr_db(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref64, err = ref.double(), y.double() - ref.double()
    noise = float(err.pow(2).sum())
    if not math.isfinite(noise):
        return float("nan")
    return min(EXACT_DB, 10.0 * math.log10(float(ref64.pow(2).sum()) / max(noise, 1e-300)))


def check_block(path: BlockPath, device: torch.device, tp_size: int, device_name: str, shares: Shares | None = None) -> NumericsReport:
    """Each part on the same inputs as the fp32 reference, then the whole block: dB per part, on `device`. Rank r
    holds LOCAL_HEADS heads and LOCAL_FFN columns per unit of its share (small(shares): one unit each when even)."""
    t0 = time.perf_counter()
    units = small(shares or even(tp_size))
    w = _weights(sum(units), device)
    g = torch.Generator(device="cpu").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    x, table, mods = randn(TOKENS, HIDDEN), _rope_table(g).to(device), [0.1 * randn(HIDDEN) for _ in range(6)]
    ref, ours = _ReferenceOps(w, table, units), _PathOps(path, w, table, units)
    xd = x.to(path.dtype)
    q, k, v = randn(TOKENS, LOCAL_HEADS, HEAD_DIM), randn(TOKENS, LOCAL_HEADS, HEAD_DIM), randn(1, LOCAL_HEADS, TOKENS, HEAD_DIM)
    qk_ref, qk_ours = (q.clone(), k.clone()), (q.to(path.dtype), k.to(path.dtype))
    nw = w["norm"][1, :HEAD_DIM]
    with torch.no_grad():
        ref.qk_norm_rope(*qk_ref, table, nw, nw, EPS)
        ours.qk_norm_rope(*qk_ours, ours.table, nw.to(path.dtype), nw.to(path.dtype), EPS)
        qh, kh = (t.transpose(0, 1).unsqueeze(0) for t in qk_ref)
        scale1, shift = 1 + mods[0], mods[1]
        parts = {
            "int8 GEMM": sqnr_db(ours.row("fc2", ours.column("fc1", xd, 0), 0, "swiglu"), ref.row("fc2", ref.column("fc1", x, 0), 0, "swiglu")),
            "q/k norm + rope": sqnr_db(torch.cat(qk_ours), torch.cat(qk_ref)),
            "attention": sqnr_db(ours.attention(*(t.to(path.dtype) for t in (qh, kh, v)), LOCAL_HEADS), ref.attention(qh, kh, v, LOCAL_HEADS)),
            "norm + modulation": sqnr_db(ours.norm_modulate(xd, w["norm"][0, HEAD_DIM:].to(path.dtype), EPS, scale1.to(path.dtype), shift.to(path.dtype)),
                                         ref.norm_modulate(x, w["norm"][0, HEAD_DIM:], EPS, scale1, shift)),
            "block": sqnr_db(_updates(xd, mods, ours), _updates(x, mods, ref)),
        }  # fmt: skip
    if path.norm_modulate is None:
        parts.pop("norm + modulation")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return NumericsReport(device_name, parts, dict(path.names), time.perf_counter() - t0)


def _updates(x, mods, ops) -> torch.Tensor:
    """What the block (one modulation segment) adds to the stream, attention branch then MLP branch. The updates,
    not the stream: x itself (and its rounding in the activation dtype) would hide the block's error."""
    out = block(x, [m.unsqueeze(0) for m in mods], [(0, len(x), 0)], ops, {})
    return torch.cat([out["attn_update"], out["mlp_update"]])


def _weights(units: int, device: torch.device) -> dict[str, torch.Tensor]:
    """fp32 weights of a block of `units` x the local widths, fan-in scaled."""
    g = torch.Generator(device="cpu").manual_seed(0)
    inner, ffn = units * LOCAL_HEADS * HEAD_DIM, units * LOCAL_FFN

    def lin(n, k):
        return (torch.randn(n, k, generator=g) / math.sqrt(k)).to(device)

    return {"qkv": lin(3 * inner, HIDDEN), "out": lin(HIDDEN, inner), "fc1": lin(2 * ffn, HIDDEN), "fc2": lin(HIDDEN, ffn),
            "norm": (1 + 0.1 * torch.randn(4, HEAD_DIM + HIDDEN, generator=g)).to(device)}  # fmt: skip


def _rope_table(g: torch.Generator) -> torch.Tensor:
    angle = torch.rand(TOKENS, ROPE_PAIRS, generator=g) * 2 * math.pi
    c, s = angle.cos(), angle.sin()
    return torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2).view(1, TOKENS, 1, ROPE_PAIRS, 2, 2)


def _columns(name: str, rank: int, units: Shares) -> slice:
    """Rank `rank`'s slice of a split width: the heads' (qkv, out) or the FFN's (fc1, fc2), per packed part."""
    per_unit = LOCAL_HEADS * HEAD_DIM if name in ("qkv", "out") else LOCAL_FFN
    return slice(sum(units[:rank]) * per_unit, sum(units[: rank + 1]) * per_unit)


def _rank_rows(t: torch.Tensor, name: str, rank: int, units: Shares) -> torch.Tensor:
    """The rows of column-parallel weight (or scale) `t` that rank `rank` holds: its slice of each packed part."""
    return torch.cat([part[_columns(name, rank, units)] for part in t.chunk({"qkv": 3, "fc1": 2}[name])])


def block(x: torch.Tensor, mods, segments, ops, seen: dict) -> dict[str, torch.Tensor]:
    """The reference H3 DiT block on the stream `x` [S, hidden], shared by this check and the dist tests.

    mods: shift, scale, gate of the attention branch, then of the MLP branch, each [rows, hidden]; segments: (start,
    end, row) for each modality's tokens. `ops` makes the calls _ReferenceOps makes, over ops.ranks (one rank's share
    each, summed as the all-reduce sums; a real TP rank has one, whose row-parallel layers all-reduce themselves).
    Returns each branch's output and update and the stream after; `seen` gets the last rank's qkv, att and fc1."""
    shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = (m.to(x.dtype) for m in mods)
    h = _modulated(ops, x, 0, scale_a, shift_a, segments)
    attn = []
    for r in ops.ranks:
        qkv = ops.column("qkv", h, r)
        q, k, v = (t.reshape(len(x), -1, ops.head_dim).contiguous() for t in qkv.chunk(3, dim=-1))
        ops.qk(q, k)
        att = ops.attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), q.shape[1]).reshape(len(x), -1)
        attn.append(ops.row("out", att, r))
        seen.update(qkv=qkv, att=att)
    attn_out = ops.reduce(attn)
    attn_update = _rows(gate_a, segments) * attn_out.to(x.dtype)
    x = x + attn_update
    h = _modulated(ops, x, 1, scale_m, shift_m, segments)
    mlp = []
    for r in ops.ranks:
        fc1 = ops.column("fc1", h, r)
        mlp.append(ops.row("fc2", fc1, r, "swiglu"))
        seen.update(fc1=fc1)
    mlp_out = ops.reduce(mlp)
    mlp_update = _rows(gate_m, segments) * mlp_out.to(x.dtype)
    return {"attn_out": attn_out, "attn_update": attn_update, "mlp_out": mlp_out, "mlp_update": mlp_update, "out": x + mlp_update}


def _rows(v: torch.Tensor, segments) -> torch.Tensor:
    """A [rows, hidden] modulation as [S, hidden]: each segment's tokens get its row."""
    return torch.cat([v[r].expand(b - a, -1) for a, b, r in segments])


def _modulated(ops, x, which, scale, shift, segments) -> torch.Tensor:
    return torch.cat([ops.norm(x[a:b], which, 1 + scale[r], shift[r]) for a, b, r in segments])


class _ReferenceOps:
    """Every rank of the TP set in this one process, on the check's own weights (w) and rope table: fp32 math on the
    unquantised weights, plain torch ops."""

    head_dim = HEAD_DIM

    def __init__(self, w: dict[str, torch.Tensor], table: torch.Tensor, units: Shares):
        self.w, self.table, self.units, self.ranks = w, table, units, range(len(units))

    def norm(self, x, which, scale1, shift):
        return self.norm_modulate(x, self.w["norm"][3 * which, HEAD_DIM:].to(x.dtype), EPS, scale1, shift)

    def qk(self, q, k):
        nw = self.w["norm"].to(q.dtype)
        self.qk_norm_rope(q, k, self.table, nw[1, :HEAD_DIM], nw[2, :HEAD_DIM], EPS)

    @staticmethod
    def reduce(parts: list[torch.Tensor]) -> torch.Tensor:
        return sum(parts[1:], parts[0])

    @staticmethod
    def norm_modulate(x, w, eps, scale1, shift):
        return F.rms_norm(x, (x.shape[-1],), w, eps) * scale1 + shift

    def column(self, name, h, rank):
        return F.linear(h, _rank_rows(self.w[name], name, rank, self.units))

    def row(self, name, a, rank, input_act=None):
        return F.linear(apply_input_act(a, input_act), self.w[name][:, _columns(name, rank, self.units)])

    @staticmethod
    def qk_norm_rope(q, k, table, qw, kw, eps):
        for t, w in ((q, qw), (k, kw)):
            n = F.rms_norm(t, (t.shape[-1],), w, eps)
            a, b = n[..., :ROPE_PAIRS], n[..., ROPE_PAIRS : 2 * ROPE_PAIRS]
            f = table[0]  # [S, 1, P, 2, 2]
            t.copy_(torch.cat([f[..., 0, 0] * a + f[..., 0, 1] * b, f[..., 1, 0] * a + f[..., 1, 1] * b, n[..., 2 * ROPE_PAIRS :]], -1))

    @staticmethod
    def attention(q, k, v, heads):
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v  # [1, H, S, D]
        return att.transpose(1, 2).reshape(1, q.shape[2], heads * q.shape[-1])


class _PathOps(_ReferenceOps):
    """The rank's path: int8 slices through `path.gemm`, its rope, attention and norm kernels."""

    def __init__(self, path: BlockPath, w: dict[str, torch.Tensor], table: torch.Tensor, units: Shares):
        super().__init__(w, table.to(path.dtype), units)
        self.p, self.q8 = path, {n: path.quantize_weight(t, 256) for n, t in w.items() if n != "norm"}
        self.qk_norm_rope, self.attention = path.qk_norm_rope, path.attention
        self.norm_modulate = path.norm_modulate or _ReferenceOps.norm_modulate

    def column(self, name, h, rank):
        q, s = (_rank_rows(t, name, rank, self.units) for t in self.q8[name])
        return self.p.gemm(h, q, s, None, h.dtype, 256, None)

    def reduce(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return sum_here(parts, self.p.wire)

    def row(self, name, a, rank, input_act=None):
        """This rank's K slice of an int8 row-parallel weight (per-row scales kept; the K slices are whole ConvRot
        groups), its partial sum in the reduce dtype, through the core's own local GEMM (tp2.layers.local_linear)."""
        q, s = self.q8[name]
        weight = Int8Weight(q[:, _columns(name, rank, self.units)].contiguous(), s, 256)
        return local_linear(a, weight, None, self.p.reduce_dtype, self.p.gemm, input_act)
