"""Sequence parallelism for H3's DiT blocks (opt-in, TP2_SEQUENCE_PARALLEL=1): the replicated part is split too.

Plain TP keeps the residual stream whole on every rank, so norms, adaln modulation and gated residuals are done
tp_size times over. With sequence parallelism (Megatron-LM's) each rank keeps S/tp_size rows of the stream:

    x_r (this rank's rows) -> norm1, modulation on x_r -> all-gather -> qkv | attention | out_proj partial
      -> reduce-scatter -> x_r += gate * attn_r -> norm2, modulation -> all-gather -> fc1 | fc2 partial
      -> reduce-scatter -> x_r += gate * mlp_r

An all-gather plus a reduce-scatter move the bytes of one all-reduce, and the elementwise work per rank is
divided by tp_size. Where the gathered rows feed an int8 linear (qkv_proj, fc1), each rank quantises its own rows
first and the all-gather moves int8 rows plus row scales (TP2_SP_INT8_GATHER, default on): half the bytes, and the
quantisation is split too. Row-wise quantisation is row-independent, so the GEMM sees the very bits it would have
made from gathered bf16 rows (kernels/int8_split.py); the ranks agree on it every forward, else all gather bf16.
With TP2_SP_FUSED_NORM=1 (CUDA with Triton) each norm + modulation, and the attention's gated residual before the
second, run as one kernel per segment (kernels/norm_modulate.py): same rounding points, ulp-level differences. The first DiT block takes its rows of the full stream, the last gathers it back, so the rest
of ComfyUI's forward (refiner, final layer) is unchanged. Rows are padded to a multiple of tp_size with zeros
that no segment covers (they stay zero and are dropped). Every row's math is the same as without it: each
rank's rows carry the same sums (at tp_size 2 bit for bit).

The block forward below follows ComfyUI's DiTBlock.forward step for step and calls ComfyUI's own modulation
helpers on this rank's rows; `install` checks that those helpers exist and refuses otherwise.
"""

from __future__ import annotations

import os
import threading
import types

import torch

from ..kernels import norm_modulate
from ..tp2.collectives import all_gather_rows, all_reduce, start_all_gather_rows, start_reduce_scatter_rows
from ..tp2.errors import PlanError
from .parallel import DEFER, Int8Rows, _group, accept_int8_rows, int8_input_split, scatter_rowwise_outputs
from .state import STATE, env_flag, log

ENV_SEQUENCE_PARALLEL = "TP2_SEQUENCE_PARALLEL"
ENV_MLP_CHUNKS = "TP2_SP_MLP_CHUNKS"
ENV_INT8_GATHER = "TP2_SP_INT8_GATHER"
ENV_FUSED_NORM = "TP2_SP_FUSED_NORM"
_rows = threading.local()  # the current forward's split: full, padded, lo, hi, local segments; int8 gathers agreed


def sequence_parallel_from_env() -> bool:
    return env_flag(ENV_SEQUENCE_PARALLEL, False, "DiT blocks split the token rows over the ranks", "plain tensor parallelism")


def int8_gather_from_env() -> bool:
    return env_flag(ENV_INT8_GATHER, True, "int8 linears' inputs are gathered quantised", "they are gathered in bf16")


def fused_norm_from_env() -> bool:
    return env_flag(ENV_FUSED_NORM, False, "norm + modulation (+ gated residual) as one kernel on CUDA", "ComfyUI's own ops")


def _fused_norm_ok(block, x: torch.Tensor, segments) -> bool:
    """Whether this block's norms can run fused here: CUDA with Triton, plain norm weights (no weight function, e.g.
    a LoRA patch applied on the fly), and segments that tile this rank's rows from the first one on."""
    if not (STATE.sp_fused_norm and norm_modulate.available(x.device)):
        return False
    if any(n.weight is None or n.weight_function or n.bias_function for n in (block.norm1, block.norm2)):
        return False
    return all(a == (segments[i - 1][1] if i else 0) for i, (a, _b, _row) in enumerate(segments))


def _norm_modulated(x, norm, shift, scale, segments, gate=None, y=None) -> torch.Tensor:
    """rms_norm(x) * (1 + scale) + shift per segment, in one kernel each (after x += gate * y, in place, if given).
    Rows after the last segment (the zero pad rows) get the plain norm of zero rows, as in ComfyUI's ops: zeros."""
    import comfy.model_management

    h = torch.empty_like(x)
    w = comfy.model_management.cast_to(norm.weight, dtype=x.dtype, device=x.device)
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    for a, b, row in segments:
        scale1, shift_row = 1.0 + scale[row].to(x.dtype), shift[row].to(x.dtype)
        if gate is None:
            norm_modulate.norm_modulate(x[a:b], w, eps, scale1, shift_row, h[a:b])
        else:
            norm_modulate.gate_norm_modulate(x[a:b], y[a:b], gate[row].to(x.dtype), w, eps, scale1, shift_row, h[a:b])
    h[segments[-1][1] if segments else 0 :].zero_()
    return h


def mlp_chunks_from_env() -> int:
    """How many row pieces the sequence-parallel MLP is pipelined in (1: no overlap)."""
    raw = os.environ.get(ENV_MLP_CHUNKS, "1").strip()
    if not raw.isdigit() or not 1 <= int(raw) <= 16:
        raise ValueError(f"{ENV_MLP_CHUNKS}={raw!r}: use a whole number from 1 (no overlap) to 16.")
    return int(raw)


def _split(x: torch.Tensor, mod_segments, block) -> torch.Tensor:
    """Record this forward's row split and whether int8 gathers are on, and return this rank's rows of the full
    stream `x` (zero-padded)."""
    rank, size = STATE.env.tp_rank, STATE.env.tp_size
    full = x.shape[0]
    grain = size * STATE.sp_mlp_chunks  # every rank's rows split evenly into the MLP's pieces
    padded = -(-full // grain) * grain
    n = padded // size
    lo, hi = rank * n, (rank + 1) * n
    segments = [(max(a, lo) - lo, min(b, hi) - lo, row) for a, b, row in mod_segments if min(b, hi) > max(a, lo)]
    _rows.split = (full, padded, lo, hi, segments)
    local = x[lo : min(hi, full)]
    if local.shape[0] < n:
        local = torch.nn.functional.pad(local, (0, 0, 0, n - local.shape[0]))
    _rows.int8 = STATE.sp_int8_gather and _all_ranks_can_split(block, local)
    if getattr(_rows, "logged", None) != (full, _rows.int8):  # once per sequence length
        log.info(
            "%s sequence parallel: %d rows, this rank holds rows %d-%d (padded to %d); int8 linears' inputs gathered %s",
            STATE.tag, full, lo, min(hi, full), padded, "as int8" if _rows.int8 else "in bf16",
        )  # fmt: skip
        _rows.logged = (full, _rows.int8)
    return local.clone()


def _all_ranks_can_split(block, local: torch.Tensor) -> bool:
    """Whether every rank can quantise before gathering (decided per device, so agreed over the group: a rank
    gathering int8 while its peer gathers bf16 would pair mismatched collectives)."""
    can = all(int8_input_split(lin, local) is not None for lin in (block.attn.qkv_proj, block.mlp.fc1))
    votes = all_reduce(torch.tensor([0.0 if can else 1.0], device=local.device), _group())
    return float(votes.item()) == 0.0


class _RowsInFlight:
    """All ranks' rows of one activation on their way: bf16 rows, or int8 rows and their scales."""

    def __init__(self, local: torch.Tensor, linear):
        self.dtype, group = local.dtype, _group()
        self.split = int8_input_split(linear, local) if _rows.int8 else None
        if self.split is None:
            self.parts = (start_all_gather_rows(local, group),)
        else:
            q, scale = self.split.quantize(local)
            self.parts = (start_all_gather_rows(q, group), start_all_gather_rows(scale, group))

    def result(self, rows: int):
        """The first `rows` gathered rows: a tensor, or Int8Rows that the int8 linear multiplies as they are."""
        got = [p.result()[:rows] for p in self.parts]
        return got[0] if self.split is None else Int8Rows(got[0], got[1], self.dtype, self.split)


def _gather(local: torch.Tensor, linear=None):
    """Every rank's rows of `local` (the padding dropped), quantised on the way when they feed the int8 `linear`."""
    if linear is None:
        return all_gather_rows(local, _group())[: _rows.split[0]]
    return _RowsInFlight(local, linear).result(_rows.split[0])


def _mlp_overlapped(mlp, h: torch.Tensor) -> torch.Tensor:
    """The MLP on every rank's rows, in STATE.sp_mlp_chunks pieces: piece c's all-gather, MLP and reduce-scatter,
    with the other pieces' collectives in flight meanwhile. Returns this rank's rows of the reduced output.

    Piece c gathers the c-th slice of every rank's rows, so its reduce-scatter hands each rank back its own c-th
    slice: the pieces concatenate to this rank's rows. Pad rows (all on the last rank, at the end of its slices)
    are left out of the MLP and reduced as zeros, as in the unpipelined path."""
    full, size, group = _rows.split[0], STATE.env.tp_size, _group()
    pieces = h.chunk(STATE.sp_mlp_chunks)
    n, m = h.shape[0], pieces[0].shape[0]
    gathers = [_RowsInFlight(p, mlp.fc1) for p in pieces]  # queued at once: they overlap the MLP of earlier pieces
    scatters = []
    with scatter_rowwise_outputs(DEFER):
        for c, gathered in enumerate(gathers):
            pad = max(0, min(m, (size - 1) * n + (c + 1) * m - full))  # the last rank's pad rows in this piece (trailing)
            y = mlp(gathered.result(size * m - pad))
            if pad:
                y = torch.nn.functional.pad(y, (0, 0, 0, pad))
            scatters.append(start_reduce_scatter_rows(y, group))
    return torch.cat([s.result() for s in scatters]).to(h.dtype)


def _block_forward(helpers, self, x, t_emb, mod_segments, rope_freqs, transformer_options={}):  # noqa: B006 - ComfyUI's signature
    mod_scale_shift, mod_gate = helpers
    if self.tp2_sp_first:
        x = _split(x, mod_segments, self)
    full, padded, lo, hi, segments = _rows.split
    if x.shape[0] != hi - lo:
        raise PlanError(
            f"{STATE.tag} sequence-parallel block got {x.shape[0]} rows, expected this rank's {hi - lo} of {full}: the "
            "blocks did not run in order (a block patch?). Unset TP2_SEQUENCE_PARALLEL on every rank."
        )
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(t_emb)
    fused = _fused_norm_ok(self, x, segments)
    if fused:
        h = _norm_modulated(x, self.norm1, shift_msa, scale_msa, segments)
    else:
        h = mod_scale_shift(self.norm1(x), shift_msa, scale_msa, segments)
    with scatter_rowwise_outputs(padded):
        attn = self.attn(_gather(h, self.attn.qkv_proj), rope_freqs=rope_freqs, transformer_options=transformer_options)
    if fused:  # x += gate * attn and the second norm in one pass
        h = _norm_modulated(x, self.norm2, shift_mlp, scale_mlp, segments, gate_msa, attn)
    else:
        x = mod_gate(x, gate_msa, attn, segments)
        h = mod_scale_shift(self.norm2(x), shift_mlp, scale_mlp, segments)
    if STATE.sp_mlp_chunks > 1 and full > padded - (hi - lo):  # pad rows on the last rank only (not a tiny sequence)
        mlp = _mlp_overlapped(self.mlp, h)
    else:
        with scatter_rowwise_outputs(padded):
            mlp = self.mlp(_gather(h, self.mlp.fc1))
    x = mod_gate(x, gate_mlp, mlp, segments)
    return _gather(x) if self.tp2_sp_last else x


def install(diffusion_model: torch.nn.Module) -> None:
    """Give every DiT block of a loaded TP model the sequence-parallel forward (the refiner stays as it is)."""
    import comfy.ldm.minimax.model as h3

    helpers = (getattr(h3, "_mod_scale_shift", None), getattr(h3, "_mod_gate", None))
    if None in helpers:
        raise PlanError(
            f"{STATE.tag} TP2_SEQUENCE_PARALLEL=1 needs ComfyUI's H3 modulation helpers (_mod_scale_shift, _mod_gate), "
            "which this ComfyUI does not have. Unset TP2_SEQUENCE_PARALLEL on every rank."
        )
    blocks = list(diffusion_model.blocks)
    for i, block in enumerate(blocks):
        block.tp2_sp_first, block.tp2_sp_last = i == 0, i == len(blocks) - 1
        accept_int8_rows(block.attn.qkv_proj)
        accept_int8_rows(block.mlp.fc1)
        block.forward = types.MethodType(lambda self, *a, **k: _block_forward(helpers, self, *a, **k), block)
