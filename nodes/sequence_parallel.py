"""Sequence parallelism for H3's DiT blocks (opt-in, TP2_SEQUENCE_PARALLEL=1): the replicated part is split too.

Plain TP keeps the residual stream whole on every rank, so norms, adaln modulation and gated residuals are done
tp_size times over. With sequence parallelism (Megatron-LM's) each rank keeps 1/tp_size of the rows:

    x_r (this rank's rows) -> norm1, modulation on x_r -> all-gather -> qkv | attention | out_proj partial
      -> reduce-scatter -> x_r += gate * attn_r -> norm2, modulation -> all-gather -> fc1 | fc2 partial
      -> reduce-scatter -> x_r += gate * mlp_r

An all-gather plus a reduce-scatter move the bytes of one all-reduce, and the elementwise work per rank is
divided by tp_size. Options, all off-switchable and agreed between the ranks at each prompt:

- TP2_SP_INT8_GATHER (default on): where the gathered rows feed an int8 linear (qkv_proj, fc1), each rank
  quantises its own rows and the all-gather moves int8 rows plus row scales: half the bytes, and the
  quantisation split too. Row-wise quantisation is row-independent, so the GEMM gets the very bits it would have
  made from gathered bf16 rows (kernels/int8_split.py); the ranks vote on it once per sampling run, else all
  gather bf16.
- TP2_SP_PIECES=N (default 1): the sequence is dealt out in N pieces (tp2/sequence_layout.py), and out_proj and
  the MLP run piece by piece, each piece's reduce-scatter (and the MLP's all-gathers) in flight while the next
  piece computes.
- TP2_SP_FUSED_NORM=1 (CUDA with Triton): each norm + modulation, with the gated residual before it (the
  attention's before norm2; the previous block's MLP's before norm1, which that block leaves pending), as one
  kernel per segment (kernels/norm_modulate.py), and the q/k norm + rope as one Triton kernel
  (kernels/qk_norm_rope.py): ulp-level differences to ComfyUI's ops.

The first DiT block takes its rows of the full stream, the last gathers it back, so the rest of ComfyUI's
forward (refiner, final layer) is unchanged. Pad rows (zeros, at the end of the sequence) are in no segment and
are dropped by every gather. Every row's math is the same as without sequence parallelism (at tp_size 2 and
one piece bit for bit; with pieces the GEMMs see fewer rows per call: bit for bit on CUDA's int8 path, ulp-level
in a CPU BLAS).

The block forward below follows ComfyUI's DiTBlock.forward step for step and calls ComfyUI's own modulation
helpers on this rank's rows, and its attention is ComfyUI's Attention.forward as nodes/h3_attention.py has it;
`install` checks that what they use exists and refuses otherwise.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import textwrap
import threading
import types

import comfy.model_management
import torch

from ..kernels import norm_modulate
from ..tp2.collectives import all_reduce
from ..tp2.errors import PlanError
from ..tp2.sequence_layout import RowLayout, gather_row_scales, reduce_scatter_sequence, start_gather_sequence
from .h3_attention import attention_forward
from .parallel import DEFER, Int8Rows, _group, accept_int8_rows, int8_input_split, scatter_rowwise_outputs
from .state import STATE, env_flag, log

ENV_SEQUENCE_PARALLEL = "TP2_SEQUENCE_PARALLEL"
ENV_PIECES = "TP2_SP_PIECES"
ENV_INT8_GATHER = "TP2_SP_INT8_GATHER"
ENV_FUSED_NORM = "TP2_SP_FUSED_NORM"
_votes: dict = {}  # this sampling run's int8-gather votes, by local shape
_rows = threading.local()  # this forward's RowLayout (.layout), local segments (.segments), int8 gathers agreed (.int8),
#                            the previous block's gated MLP residual not yet added to its output (.pending)


def sequence_parallel_from_env() -> bool:
    return env_flag(ENV_SEQUENCE_PARALLEL, False, "DiT blocks split the token rows over the ranks", "plain tensor parallelism")


def int8_gather_from_env() -> bool:
    return env_flag(ENV_INT8_GATHER, True, "int8 linears' inputs are gathered quantised", "they are gathered in bf16")


def fused_norm_from_env() -> bool:
    return env_flag(ENV_FUSED_NORM, False, "norm + modulation (+ gated residual) as one kernel on CUDA", "ComfyUI's own ops")


def _fused_norm_ok(block, x: torch.Tensor, segments) -> bool:
    """Whether this block's norms can run fused here: CUDA with Triton, plain norm weights (no weight function, e.g.
    a LoRA patch applied on the fly), and segments that tile this rank's rows from the first one on."""
    if not (STATE.sp_fused_norm and norm_modulate.available(x.device, x.dtype)):
        return False
    if any(n.weight is None or n.weight_function or n.bias_function for n in (block.norm1, block.norm2)):
        return False
    return all(a == (segments[i - 1][1] if i else 0) for i, (a, _b, _row) in enumerate(segments))


def _norm_modulated(x, norm, shift, scale, segments, gate=None, y=None) -> torch.Tensor:
    """rms_norm(x) * (1 + scale) + shift per segment, in one kernel each (after x += gate * y, in place, if given).
    Rows after the last segment (the zero pad rows) get the plain norm of zero rows, as in ComfyUI's ops: zeros."""
    h = torch.empty_like(x)
    w = comfy.model_management.cast_to(norm.weight, dtype=x.dtype, device=x.device)
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    scale1, shift = 1.0 + scale.to(x.dtype), shift.to(x.dtype)  # every modulation row at once, as ComfyUI makes each
    gate = gate.to(x.dtype) if gate is not None else None
    for a, b, row in segments:
        if gate is None:
            norm_modulate.norm_modulate(x[a:b], w, eps, scale1[row], shift[row], h[a:b])
        else:
            norm_modulate.gate_norm_modulate(x[a:b], y[a:b], gate[row], w, eps, scale1[row], shift[row], h[a:b])
    h[segments[-1][1] if segments else 0 :].zero_()
    return h


def pieces_from_env() -> int:
    """How many pieces the sequence is dealt out in, for pipelining the reduce-scatters (1: no overlap)."""
    if os.environ.get("TP2_SP_MLP_CHUNKS"):
        raise ValueError("TP2_SP_MLP_CHUNKS was renamed TP2_SP_PIECES (it now pipelines out_proj too): set that instead.")
    raw = os.environ.get(ENV_PIECES, "1").strip()
    if not raw.isdigit() or not 1 <= int(raw) <= 16:
        raise ValueError(f"{ENV_PIECES}={raw!r}: use a whole number from 1 (no overlap) to 16.")
    return int(raw)


def _split(x: torch.Tensor, mod_segments, block) -> torch.Tensor:
    """Record this forward's layout, local segments and whether int8 gathers are on; return this rank's rows of
    the full stream `x` (zero rows where padded)."""
    layout = RowLayout.plan(x.shape[0], STATE.env.tp_size, STATE.env.tp_rank, STATE.sp_pieces)
    _rows.layout, _rows.segments = layout, layout.local_segments(mod_segments)
    local = layout.take(x)
    _rows.int8 = STATE.sp_int8_gather and _all_ranks_can_split(block, local)
    fused = _fused_norm_ok(block, local, _rows.segments)
    if getattr(_rows, "logged", None) != (layout, _rows.int8, fused):  # once per sequence length
        log.info(
            "%s sequence parallel: %d rows, this rank holds %d rows (%d pieces, padded to %d); norms %s; int8 linears' inputs gathered %s",
            STATE.tag, layout.full, layout.local_rows, layout.pieces, layout.padded, "fused (Triton)" if fused else "by ComfyUI's ops",
            "as int8" if _rows.int8 else "in bf16",
        )  # fmt: skip
        _rows.logged = (layout, _rows.int8, fused)
    return local


def _all_ranks_can_split(block, local: torch.Tensor) -> bool:
    """Whether every rank can quantise before gathering (decided per device, so agreed over the group: a rank
    gathering int8 while its peer gathers bf16 would pair mismatched collectives). Voted at the first forward of
    each sampling run and sequence shape (the ranks agreed on the run, so they vote at the same forward), not at
    every step: the vote makes the CPU wait for the GPU."""
    run = (STATE.sampling_key, STATE.session.generation)
    if _votes.get("run") != run:
        _votes.clear()
        _votes["run"] = run
    key = (tuple(local.shape), local.dtype)
    if key not in _votes:
        can = all(int8_input_split(lin, local) is not None for lin in (block.attn.qkv_proj, block.mlp.fc1))
        against = all_reduce(torch.tensor([0.0 if can else 1.0], device=local.device), _group())
        _votes[key] = float(against.item()) == 0.0
    return _votes[key]


class _GatherInFlight:
    """All ranks' rows of one activation on their way, in sequence order: bf16 rows, or int8 rows and scales."""

    def __init__(self, local: torch.Tensor, linear, layout: RowLayout):
        self.dtype, self.layout, group = local.dtype, layout, _group()
        self.split = int8_input_split(linear, local) if _rows.int8 and linear is not None else None
        if self.split is None:
            self.rows = start_gather_sequence(local, layout, group)
        else:
            q, scale = self.split.quantize(local)
            self.rows = start_gather_sequence(q, layout, group)
            self.scales = gather_row_scales(scale, layout, group)

    def result(self, start: int, stop: int):
        """Sequence rows [start, stop) (waiting only for the pieces that hold them): a tensor, or Int8Rows that the
        int8 linear multiplies as they are."""
        rows = self.rows.result(stop)[start:stop]
        return rows if self.split is None else Int8Rows(rows, self.scales[start:stop], self.dtype, self.split)


def _gather(local: torch.Tensor, linear=None):
    """Every rank's rows of `local` in sequence order (pad rows dropped), quantised on the way when they feed the
    int8 `linear`."""
    layout = _rows.layout
    return _GatherInFlight(local, linear, layout).result(0, layout.full)


def _mlp_in_pieces(mlp, h: torch.Tensor) -> torch.Tensor:
    """The MLP on every rank's rows, piece by piece: all pieces' all-gathers are queued at once, piece c's MLP runs
    when its rows are in, and its reduce-scatter is in flight while piece c+1 computes. Returns this rank's rows."""
    layout = _rows.layout
    p = layout.piece_rows
    gathered = _GatherInFlight(h, mlp.fc1, layout)
    with scatter_rowwise_outputs(DEFER):
        return reduce_scatter_sequence(lambda c: mlp(gathered.result(c * p, c * p + layout.valid_rows(c))), layout, _group()).to(h.dtype)


class _PendingResidual:
    """A block's `x += gate * mlp`, left for the next block to do inside its first norm (one pass fewer over x)."""

    def __init__(self, x: torch.Tensor, gate: torch.Tensor, mlp: torch.Tensor):
        self.x, self.gate, self.mlp = x, gate, mlp


def _take_pending(x: torch.Tensor, first: bool) -> _PendingResidual | None:
    pending, _rows.pending = getattr(_rows, "pending", None), None
    if first or pending is None:  # at the first block: a stale one is from a forward that raised; its x is gone
        return None
    if pending.x is not x:
        raise PlanError(
            f"{STATE.tag} a sequence-parallel block got another stream ({tuple(x.shape)}) than the previous block returned "
            f"({tuple(pending.x.shape)}, its MLP residual still to add): something ran between the blocks (a block patch?). "
            "Unset TP2_SP_FUSED_NORM on every rank."
        )
    return pending


def _may_defer(block, transformer_options) -> bool:
    """Whether this block may leave its MLP residual to the next block: only when ComfyUI's loop hands each block's
    output straight to the next one (no block replacement patches) and this is not the last block."""
    return not block.tp2_sp_last and not transformer_options.get("patches_replace", {}).get("dit")


def _block_forward(h3, self, x, t_emb, mod_segments, rope_freqs, transformer_options={}):  # noqa: B006 - ComfyUI's signature
    mod_scale_shift, mod_gate = h3._mod_scale_shift, h3._mod_gate
    pending = _take_pending(x, self.tp2_sp_first)
    if self.tp2_sp_first:
        x = _split(x, mod_segments, self)
    layout, segments = _rows.layout, _rows.segments
    if x.shape[0] != layout.local_rows:
        raise PlanError(
            f"{STATE.tag} sequence-parallel block got {x.shape[0]} rows, expected this rank's {layout.local_rows} of "
            f"{layout.full}: the blocks did not run in order (a block patch?). Unset TP2_SEQUENCE_PARALLEL on every rank."
        )
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(t_emb)
    fused = _fused_norm_ok(self, x, segments)
    if fused and pending is not None:  # the previous block's x += gate * mlp and this norm in one pass
        h = _norm_modulated(x, self.norm1, shift_msa, scale_msa, segments, pending.gate, pending.mlp)
    elif fused:
        h = _norm_modulated(x, self.norm1, shift_msa, scale_msa, segments)
    else:
        if pending is not None:
            x = mod_gate(x, pending.gate, pending.mlp, segments)
        h = mod_scale_shift(self.norm1(x), shift_msa, scale_msa, segments)
    del pending
    with scatter_rowwise_outputs(layout):
        attn = attention_forward(
            h3, self.attn, _gather(h, self.attn.qkv_proj), rope_freqs=rope_freqs, transformer_options=transformer_options, fused=fused
        )
    if fused:  # x += gate * attn and the second norm in one pass
        h = _norm_modulated(x, self.norm2, shift_mlp, scale_mlp, segments, gate_msa, attn)
    else:
        x = mod_gate(x, gate_msa, attn, segments)
        h = mod_scale_shift(self.norm2(x), shift_mlp, scale_mlp, segments)
    if layout.pieces > 1:
        mlp = _mlp_in_pieces(self.mlp, h)
    else:
        with scatter_rowwise_outputs(layout):
            mlp = self.mlp(_gather(h, self.mlp.fc1))
    if fused and _may_defer(self, transformer_options):
        _rows.pending = _PendingResidual(x, gate_mlp, mlp)
        return x
    x = mod_gate(x, gate_mlp, mlp, segments)
    return _gather(x) if self.tp2_sp_last else x


# The ComfyUI code the sequence-parallel path stands in for or leans on, with the digest of each function's source
# as it was written against (kat3ri/ComfyUI, ComfyUI 0.33): sha256 of the dedented source, first 16 hex digits.
STANDS_IN_FOR = {
    "DiTBlock.forward": "17a96f6970df756b",  # _block_forward
    "Attention.forward": "91973d57b4143f16",  # nodes/h3_attention.attention_forward
    "_mod_scale_shift": "796cae2505e9742d",  # the fused norm kernels reproduce its roundings
    "_mod_gate": "0aaa07a6860a2d3e",
    "MiniMaxH3Model._forward": "a72c515aa53aa677",  # its block loop hands each output straight on (the pending residual)
}


def source_digest(obj) -> str:
    return hashlib.sha256(textwrap.dedent(inspect.getsource(obj)).encode()).hexdigest()[:16]


def changed_comfy_code(h3, expected: dict[str, str] = STANDS_IN_FOR) -> list[str]:
    """The functions of ComfyUI's H3 module whose source is not what the sequence-parallel path was written against."""
    changed = []
    for dotted, want in expected.items():
        obj = h3
        try:
            for part in dotted.split("."):
                obj = getattr(obj, part)
            got = source_digest(obj)
        except (AttributeError, OSError, TypeError):
            got = "missing"
        if got != want:
            changed.append(f"{dotted} ({got}, written against {want})")
    return changed


def install(diffusion_model: torch.nn.Module) -> bool:
    """Give every DiT block of a loaded TP model the sequence-parallel forward (the refiner stays as it is).

    Returns False, with one log line, and changes nothing when ComfyUI's code that the path stands in for changed:
    then plain TP runs (the same result, a little slower)."""
    import comfy.ldm.minimax.model as h3

    changed = changed_comfy_code(h3)
    if changed:
        log.warning(
            "%s sequence parallelism off for this model: ComfyUI's H3 code it stands in for changed (%s); plain TP runs",
            STATE.tag,
            "; ".join(changed),
        )
        return False
    needed = ("_mod_scale_shift", "_mod_gate", "optimized_attention")
    missing = [name for name in needed if getattr(h3, name, None) is None]
    if missing:
        raise PlanError(
            f"{STATE.tag} TP2_SEQUENCE_PARALLEL=1 needs {', '.join(needed)} in ComfyUI's H3 model module, and this "
            f"ComfyUI lacks {', '.join(missing)}. Unset TP2_SEQUENCE_PARALLEL on every rank."
        )
    blocks = list(diffusion_model.blocks)
    for i, block in enumerate(blocks):
        block.tp2_sp_first, block.tp2_sp_last = i == 0, i == len(blocks) - 1
        accept_int8_rows(block.attn.qkv_proj)
        accept_int8_rows(block.mlp.fc1)
        block.forward = types.MethodType(lambda self, *a, **k: _block_forward(h3, self, *a, **k), block)
    return True
