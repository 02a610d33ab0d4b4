"""Sequence parallelism for H3's DiT blocks (opt-in, TP2_SEQUENCE_PARALLEL=1): each rank keeps 1/tp_size of the rows.

    x_r -> norm1, modulation -> all-gather -> qkv | attention | out_proj partial -> reduce-scatter -> x_r += gate * attn_r
        -> norm2, modulation -> all-gather -> fc1 | fc2 partial -> reduce-scatter -> x_r += gate * mlp_r

The first block takes this rank's rows, the last gathers them back; pad rows (zeros, at the end) are in no segment and
gathers drop them. Row math is unchanged. Gathers may carry int8 rows (TP2_SP_INT8_GATHER, voted per run); norms may
run fused (TP2_SP_FUSED_NORM=1, CUDA with Triton: kernels/norm_modulate.py, one kernel per modulation segment; norm1
then adds the previous block's pending MLP residual). Blocks follow ComfyUI's DiTBlock.forward; `install` falls back
to plain TP if that code changed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import textwrap
from dataclasses import dataclass

import comfy.model_management
import torch

from ..kernels import norm_modulate
from ..tp2 import settings
from ..tp2.collectives import all_reduce, start_all_gather_rows
from ..tp2.errors import PlanError
from ..tp2.layers import PARTIAL, STARTED, reduced
from ..tp2.sequence_layout import RowLayout, chunk_bounds, clip_segments
from ..tp2.wire import start_sum
from .h3_attention import attention_forward
from .parallel import Int8Rows, held_weight, int8_input_split, int8_rows_call, int8_rows_or_own, int8_weighted, rowwise_call, tp_group
from .patches import changes_of
from .state import STATE, log

SP_FORWARD = "tp2_sequence_parallel"  # transformer_options key of the model evaluation's SequenceParallelForward
_logged: tuple | None = None  # the last (layout, int8, fused) logged: one line per sequence length
_votes: dict = {}  # this sampling run's int8-gather votes, by local shape


@dataclass
class SequenceParallelForward:
    """One model evaluation's sequence-parallel state, handed from block to block in transformer_options: the row
    layout and this rank's segments (set by the first block), the int8-gather vote, and a block's `x += gate * mlp`
    as (x, gate, mlp), left for the next block to do inside its first norm (with the fused norms: one pass fewer over x)."""

    layout: RowLayout | None = None
    segments: list | None = None
    int8: bool = False
    pending: tuple | None = None
    gathered: bool = False  # the last block ran and gathered the rows back


def vote_int8_gathers(block, local: torch.Tensor) -> bool:
    """Whether every rank can quantise before gathering, agreed over the group (int8 on one rank and bf16 on its peer
    would pair mismatched collectives). Voted at the first forward of each sampling run and sequence shape (the same
    forward on every rank), not at every step: the vote makes the CPU wait for the GPU."""
    run = (STATE.sampling_key, STATE.session.generation)
    if _votes.get("run") != run:
        _votes.clear()
        _votes["run"] = run
    key = (tuple(local.shape), local.dtype)
    if key not in _votes:
        can = all(int8_input_split(lin, local) is not None for lin in (block.attn.qkv_proj, block.mlp.fc1))
        against = all_reduce(torch.tensor([0.0 if can else 1.0], device=local.device), tp_group())
        _votes[key] = float(against.item()) == 0.0
    return _votes[key]


def gather(sp, local: torch.Tensor, linear=None):
    """Every rank's rows of `local` in sequence order (pad rows dropped), quantised on the way when they feed the
    int8 `linear`: a tensor, or Int8Rows that the int8 linear multiplies as they are."""
    full, group = sp.layout.full, tp_group()
    split = int8_input_split(linear, local) if sp.int8 and linear is not None else None
    if split is None:
        return start_all_gather_rows(local, group).result()[:full]
    q, scale = split.quantize(local)
    rows = start_all_gather_rows(q, group)
    scales = start_all_gather_rows(scale, group).result()
    return Int8Rows(rows.result()[:full], scales[:full], local.dtype, split)


def fused_norm_ok(block, x: torch.Tensor, segments) -> bool:
    """Whether this block's norms can run fused here: CUDA with Triton, plain norm weights (no weight function, e.g.
    a LoRA patch applied on the fly), and segments that tile this rank's rows from the first one on."""
    if not (settings.value("TP2_SP_FUSED_NORM") and norm_modulate.available(x.device, x.dtype)):
        return False
    if any(n.weight is None or n.weight_function or n.bias_function for n in (block.norm1, block.norm2)):
        return False
    return all(a == (segments[i - 1][1] if i else 0) for i, (a, _b, _row) in enumerate(segments))


def gated_norm(h3, fused: bool, x, norm, shift, scale, segments, gate=None, y=None):
    """(x, its modulated norm) after x += gate * y where given. Without `fused`: ComfyUI's ops (h3's _mod_gate and
    _mod_scale_shift). With it: rms_norm(x) * (1 + scale) + shift per segment in one kernel each (x += gate * y in
    place in it); rows after the last segment (the zero pad rows) get the plain norm of zero rows, as in ComfyUI's ops: zeros."""
    if not fused:
        if gate is not None:
            x = h3._mod_gate(x, gate, y, segments)
        return x, h3._mod_scale_shift(norm(x), shift, scale, segments)
    h = torch.empty_like(x)
    w = comfy.model_management.cast_to(norm.weight, dtype=x.dtype, device=x.device)
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    scale1, shift = 1.0 + scale.to(x.dtype), shift.to(x.dtype)  # every modulation row at once, as ComfyUI makes each
    gate = gate.to(x.dtype) if gate is not None else None
    for a, b, row in segments:
        residual = () if gate is None else (gate[row], y[a:b])
        norm_modulate.norm_modulate(x[a:b], w, eps, scale1[row], shift[row], h[a:b], *residual)
    h[segments[-1][1] if segments else 0 :].zero_()
    return x, h


def _split(sp: SequenceParallelForward, x: torch.Tensor, mod_segments, block) -> torch.Tensor:
    """Record this evaluation's layout, local segments and int8 vote in `sp`; this rank's rows of `x` (zero-padded)."""
    global _logged
    layout = RowLayout.plan(x.shape[0], STATE.env.tp_size, STATE.env.tp_rank)
    sp.layout, sp.segments = layout, layout.local_segments(mod_segments)
    local = layout.take(x)
    sp.int8 = settings.value("TP2_SP_INT8_GATHER") and vote_int8_gathers(block, local)
    fused = fused_norm_ok(block, local, sp.segments)
    if _logged != (layout, sp.int8, fused):
        log.info(
            "%s sequence parallel: %d rows, this rank holds %d rows (padded to %d); the MLP in %d row chunks; norms %s; int8 linears' inputs gathered %s",
            STATE.tag, layout.full, layout.m, layout.padded, len(chunk_bounds(layout.full, settings.value("TP2_SP_CHUNK_ROWS"))),
            "fused (Triton)" if fused else "by ComfyUI's ops", "as int8" if sp.int8 else "in bf16",
        )  # fmt: skip
        _logged = (layout, sp.int8, fused)
    return local


def _mlp_rows(mlp, rows) -> torch.Tensor:
    """fc2's partial sums (reduce dtype) for the gathered `rows`, in chunks of at most TP2_SP_CHUNK_ROWS rows, so
    fc1's output exists for one chunk at a time; each weight is cast once for all chunks (held_weight)."""
    chunks = chunk_bounds(rows.shape[0], settings.value("TP2_SP_CHUNK_ROWS"))
    if len(chunks) == 1:
        return rowwise_call(mlp.fc2, mlp.fc1(rows), "swiglu", PARTIAL)
    out, fc1, fc2 = None, None, None
    with contextlib.ExitStack() as hold:
        for a, b in chunks:
            if isinstance(rows, Int8Rows):
                fc1 = fc1 or hold.enter_context(held_weight(mlp.fc1, rows[a:b]))
                up = int8_rows_call(mlp.fc1, rows[a:b], fc1)
            else:
                up = mlp.fc1(rows[a:b])
            fc2 = fc2 or hold.enter_context(held_weight(mlp.fc2, up))
            y = rowwise_call(mlp.fc2, up, "swiglu", PARTIAL, fc2)
            del up
            if out is None:
                out = y.new_empty((rows.shape[0], y.shape[1]))
            out[a:b] = y
            del y
    return out


def install_pipelined_blocks(diffusion_model: torch.nn.Module) -> None:
    """Plain TP: every DiT block through _pipelined_block (unless ComfyUI's code it stands in for changed)."""
    import comfy.ldm.minimax.model as h3

    if not changed_comfy_code(h3):
        for i, block in enumerate(diffusion_model.blocks):
            changes_of(diffusion_model).replace(
                f"blocks.{i}.forward", block, "forward", lambda own, b=block: functools.partial(_pipelined_block, h3, b, own)
            )


def _pipelined_block(h3, self, own, x, t_emb, mod_segments, rope_freqs, transformer_options={}):  # noqa: B006 - ComfyUI's
    """ComfyUI's DiTBlock.forward (`own`) under plain TP; with TP2_OVERLAP and int8 linears, out_proj's sum arrives in
    chunks of tokens, and each chunk's residual, norm and MLP run as soon as its chunk is summed, while the later
    chunks still travel; each chunk's fc2 sum travels while the next chunk computes (the same bytes: see reduced)."""
    tp = tp_group()
    if tp.overlap == 1 or not all(int8_weighted(m) for m in (self.attn.out_proj, self.mlp.fc1, self.mlp.fc2)):
        return own(x, t_emb, mod_segments, rope_freqs, transformer_options=transformer_options)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(t_emb)
    h = [h3._mod_scale_shift(self.norm1(x), shift_msa, scale_msa, mod_segments)]
    mlp = []
    for a, b, attn in attention_forward(h3, self.attn, h, rope_freqs, transformer_options, out_reduce=STARTED):
        segments = clip_segments(mod_segments, a, b)
        rows = h3._mod_gate(x[a:b], gate_msa, attn.result(), segments)  # x's rows, in place
        rows = h3._mod_scale_shift(self.norm2(rows), shift_mlp, scale_mlp, segments)
        mlp.append((a, b, segments, start_sum(_mlp_rows(self.mlp, rows), tp, tp.wire, rows.dtype, False)))
    for a, b, segments, y in mlp:
        h3._mod_gate(x[a:b], gate_mlp, y.result(), segments)
    return x


def _entered(self, x, mod_segments, transformer_options):
    """This model call's sequence-parallel state, `x` as this rank's rows, and the previous block's deferred residual
    (gate, mlp), or (None, None)."""
    sp = transformer_options.get(SP_FORWARD)
    if sp is None:
        raise PlanError(
            f"{STATE.tag} a sequence-parallel DiT block ran outside the pack's model call (no {SP_FORWARD} in its "
            "transformer_options): another node pack calls the blocks itself. Unset TP2_SEQUENCE_PARALLEL on every rank."
        )
    if sp.layout is None:  # the first block that runs (SkipLayerGuidanceDiT may skip block 0)
        x = _split(sp, x, mod_segments, self)
    pending_x, gate, mlp = sp.pending or (x, None, None)  # (x, None, None): no residual left to add
    sp.pending = None
    if pending_x is not x:
        raise PlanError(
            f"{STATE.tag} a sequence-parallel block got another stream ({tuple(x.shape)}) than the previous block returned "
            f"({tuple(pending_x.shape)}, its MLP residual still to add): something ran between the blocks (a block patch?). "
            "Unset TP2_SP_FUSED_NORM on every rank."
        )
    if sp.layout is None or x.shape[0] != sp.layout.m:
        raise PlanError(
            f"{STATE.tag} sequence-parallel block got {x.shape[0]} rows, expected this rank's share of the sequence: "
            "the blocks did not run in order (a block patch?). Unset TP2_SEQUENCE_PARALLEL on every rank."
        )
    return sp, x, (gate, mlp)


def _block_forward(h3, self, x, t_emb, mod_segments, rope_freqs, transformer_options={}):  # noqa: B006 - ComfyUI's signature
    sp, x, (gate, y) = _entered(self, x, mod_segments, transformer_options)
    layout, segments = sp.layout, sp.segments
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(t_emb)
    fused = fused_norm_ok(self, x, segments)
    x, h = gated_norm(h3, fused, x, self.norm1, shift_msa, scale_msa, segments, gate, y)  # the previous block's residual first
    # every activation is dropped as soon as nothing reads it (attention_forward empties the list)
    rows = [gather(sp, h, self.attn.qkv_proj)]
    del gate, y, h
    attn = attention_forward(h3, self.attn, rows, rope_freqs, transformer_options, fused=fused, out_reduce=layout)
    x, h = gated_norm(h3, fused, x, self.norm2, shift_mlp, scale_mlp, segments, gate_msa, attn)
    gathered = gather(sp, h, self.mlp.fc1)
    del attn, h
    # ComfyUI's MLP.forward (fc2(swiglu(fc1(x))), fc2 row-parallel) on every rank's rows: this rank's rows of its output
    mlp_rows = functools.partial(lambda rows, a, b: _mlp_rows(self.mlp, rows[a:b]), gathered)
    mlp = reduced(mlp_rows, layout.full, tp_group(), layout, int8_weighted(self.mlp.fc2), gathered.dtype)
    del gathered, mlp_rows
    # the MLP residual is left to the next block only where ComfyUI's loop hands each block's output straight to the
    # next one (no block replacement patches)
    if fused and not self.tp2_sp_last and not transformer_options.get("patches_replace", {}).get("dit"):
        sp.pending = (x, gate_mlp, mlp)
        return x
    x = h3._mod_gate(x, gate_mlp, mlp, segments)
    sp.gathered = self.tp2_sp_last
    return gather(sp, x) if self.tp2_sp_last else x


def with_last_block_gathered(dm, transformer_options: dict) -> dict:
    """`transformer_options` in which a replacement of the last DiT block (SkipLayerGuidanceDiT's skip) still hands the
    final layer every rank's rows: where the block it stands for (which gathers them) did not run, its output is."""
    key, replace = ("double_block", len(dm.blocks) - 1), transformer_options.get("patches_replace", {})
    patch, sp = replace.get("dit", {}).get(key), transformer_options[SP_FORWARD]
    if patch is None or not getattr(dm.blocks[-1], "tp2_sp_last", False):
        return transformer_options

    def last_block(args, extra):
        out = patch(args, extra)
        return out if sp.gathered or sp.layout is None else dict(out, img=gather(sp, out["img"]))

    return dict(transformer_options, patches_replace=dict(replace, dit={**replace["dit"], key: last_block}))


# The ComfyUI code the sequence-parallel path stands in for or leans on: sha256 of the dedented source, 16 hex digits.
STANDS_IN_FOR = {
    "DiTBlock.forward": "17a96f6970df756b",  # _block_forward
    "Attention.forward": "91973d57b4143f16",  # nodes/h3_attention.attention_forward
    "_mod_scale_shift": "796cae2505e9742d",  # the fused norm kernels reproduce its roundings
    "_mod_gate": "0aaa07a6860a2d3e",
    "MLP.forward": "6dc02869745c7552",  # _mlp_rows: fc2(swiglu(fc1(x))) in row chunks, with the reduction named
    "MiniMaxH3Model._forward": "a72c515aa53aa677",  # its block loop hands each output straight on (the pending residual)
}


def changed_comfy_code(h3) -> list[str]:
    """The functions of ComfyUI's H3 module whose source is not what the sequence-parallel path was written against."""
    changed = []
    for dotted, want in STANDS_IN_FOR.items():
        try:
            obj = functools.reduce(getattr, dotted.split("."), h3)
            got = hashlib.sha256(textwrap.dedent(inspect.getsource(obj)).encode()).hexdigest()[:16]
        except (AttributeError, OSError, TypeError):
            got = "missing"
        if got != want:
            changed.append(f"{dotted} ({got}, written against {want})")
    return changed


def install(diffusion_model: torch.nn.Module) -> bool:
    """Give every DiT block of a loaded TP model the sequence-parallel forward (the refiner stays as it is). Returns
    False, with one log line, and changes nothing when ComfyUI's code that the path stands in for changed."""
    import comfy.ldm.minimax.model as h3

    changed = changed_comfy_code(h3)
    if changed:
        log.warning(
            "%s sequence parallelism off for this model: ComfyUI's H3 code it stands in for changed (%s); plain TP runs",
            STATE.tag,
            "; ".join(changed),
        )
        return False
    blocks, changes = list(diffusion_model.blocks), changes_of(diffusion_model)
    for i, block in enumerate(blocks):
        block.tp2_sp_last = i == len(blocks) - 1
        for name in ("attn.qkv_proj", "mlp.fc1"):  # the linears the gathers feed: they take Int8Rows too
            lin = block.get_submodule(name)
            changes.replace(f"blocks.{i}.{name}.forward", lin, "forward", lambda own, m=lin: functools.partial(int8_rows_or_own, m, own))
        changes.replace(f"blocks.{i}.forward", block, "forward", lambda own, b=block: functools.partial(_block_forward, h3, b))
    return True
