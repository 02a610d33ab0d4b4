"""H3's text encoder under TP: the CLIPLoader hook, the wiring of the built encoder, and the encode every rank runs together.

For H3's Qwen3-VL-32B file (CLIPLoader type 'minimax', tp_size > 1) the plan (tp2/te_plan.py) is checked before any
weight is read, this rank reads only its slices, and ComfyUI builds its own encoder at this rank's width (its
`qwen3vl_32b_model_config` override). o_proj and down_proj are row-parallel; the token embedding looks up this rank's
rows and all-reduces (exact: each token's row comes from one rank). Each encode is a rendezvous (prompt, plan, digest
of the inputs), then the ranks run the layers in step; a rank that does not arrive fails the prompt.
"""

from __future__ import annotations

import functools
import hashlib
import time

import comfy.sd
import comfy.utils
import torch

from ..tp2.checkpoint import CheckpointLayout
from ..tp2.collectives import all_reduce
from ..tp2.errors import PeerLostError, PlanError, TP2Error
from ..tp2.plan import ROWWISE
from ..tp2.same_bytes import bytes_digest
from ..tp2.te_plan import TEPlan, is_h3_text_encoder, resolve_te_plan
from .loader import open_shard, record_load
from .lora import TE_PLAN_ATTR
from .parallel import full_precision_rowwise_call, planned_linears, refuse_widths, role_guard, tp_group
from .patches import PATCHES, changes_of
from .run import agree_step, in_step, step_key
from .state import STATE, log

CONFIG_KEY = "qwen3vl_32b_model_config"  # ComfyUI's per-model config override (comfy/sd1_clip.py SDClipModel)
TE_ATTR = "qwen3vl_32b"  # MiniMaxH3TEModel's SDClipModel attribute (its name)


def install_text_encoder_hook() -> None:
    PATCHES.install(comfy.sd, "load_clip", _hooked_load_clip)


def _hooked_load_clip(original):
    """comfy.sd.load_clip: H3's encoder file as this rank's slices, everything else through `original`."""

    @functools.wraps(original)
    def load_clip(
        ckpt_paths,
        embedding_directory=None,
        clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION,
        model_options={},  # noqa: B006 - ComfyUI's signature
        disable_dynamic=False,
    ):
        if not _is_h3_encoder(ckpt_paths, clip_type):
            return original(ckpt_paths, embedding_directory, clip_type, model_options, disable_dynamic)
        t0 = time.monotonic()
        shard = open_shard(ckpt_paths[0])  # the plan refuses before a byte of weights is read
        sd, metadata, plan = shard.state_dict, shard.metadata, shard.plan
        if model_options.get("custom_operations") is None:
            sd, metadata = comfy.utils.convert_old_quants(sd, model_prefix="", metadata=metadata)
        options = dict(model_options, **{CONFIG_KEY: {**model_options.get(CONFIG_KEY, {}), **plan.local_config(STATE.env.tp_rank)}})
        clip = comfy.sd.load_text_encoder_state_dicts([sd], embedding_directory, clip_type, options, disable_dynamic)
        clip.patcher.cached_patcher_init = (comfy.sd.load_clip_model_patcher, (ckpt_paths, embedding_directory, clip_type, model_options))
        wire_text_encoder(clip, plan)
        record_load("text encoder ", ckpt_paths[0], shard, t0, changes_of(clip.cond_stage_model))
        return clip

    return load_clip


def _is_h3_encoder(ckpt_paths, clip_type) -> bool:
    """Whether this is an H3 encoder file this rank must load in slices (else ComfyUI loads it as it is)."""
    if not STATE.active or STATE.env.tp_size < 2 or clip_type != comfy.sd.CLIPType.MINIMAX or len(ckpt_paths) != 1:
        return False
    if not ckpt_paths[0].endswith((".safetensors", ".sft")):
        return False
    layout = CheckpointLayout.from_file(ckpt_paths[0])
    if is_h3_text_encoder(layout):
        return True
    qwen = any(k.endswith("layers.0.self_attn.q_proj.weight") for k in layout.tensors)  # what a user might pick by mistake
    if qwen and "model.audio_decoder.projection.weight" not in layout.tensors:
        resolve_te_plan(layout, STATE.env.tp_size, STATE.shares)  # raises: a Qwen language model that is not H3's encoder
    return False


def wire_text_encoder(clip, plan: TEPlan) -> None:
    """Roles on every linear, row-parallel forwards, the width check, and the encode rendezvous."""
    encoder = getattr(clip.cond_stage_model, TE_ATTR)
    transformer, r = encoder.transformer, STATE.env.tp_rank
    why = f"(tp_size={plan.tp_size}) ComfyUI ignored the pack's width override; report this with your ComfyUI version."
    rows = {"vocabulary rows": transformer.model.embed_tokens.num_embeddings}
    refuse_widths("the text encoder's embedding", rows, {"vocabulary rows": plan.local("vocab", r)}, why)
    want = {"heads": plan.local("q", r), "KV heads": plan.local("kv", r), "head_dim": plan.head_dim, "FFN": plan.local("ffn", r)}
    for i, layer in enumerate(transformer.model.layers):
        attn = layer.self_attn
        built = {"heads": attn.num_heads, "KV heads": attn.num_kv_heads, "head_dim": attn.head_dim, "FFN": layer.mlp.down_proj.in_features}
        refuse_widths(f"text encoder layer {i}", built, want, why)
    setattr(clip.cond_stage_model, TE_PLAN_ATTR, plan)  # read by the LoRA hook (nodes/lora.py)
    changes = changes_of(clip.cond_stage_model)
    for name, module, style in planned_linears(transformer, plan.linears, "text encoder"):
        if style == ROWWISE:
            # the row-parallel forward is the full-precision one ComfyUI gives every quantised text encoder linear
            # (comfy/sd1_clip.py); a layer built with a quantised GEMM would compute otherwise split than whole: refused
            if getattr(module, "layout_type", None) is not None and not getattr(module, "_full_precision_mm", False):
                raise PlanError(
                    f"{STATE.tag} text encoder layer '{name}' was built with a quantised GEMM ({module.layout_type}), not the "
                    "full-precision matmul ComfyUI gives a text encoder (custom operations from another node pack?). The pack "
                    "splits only the latter: load the encoder without that pack, or run with --tp-size 1."
                )
            changes.replace(f"{name}.forward", module, "forward", lambda own, m=module: functools.partial(full_precision_rowwise_call, m))
    changes.replace("model.embed_tokens.forward", transformer.model.embed_tokens, "forward", lambda own: _vocab_parallel_forward(own, plan))
    # SDClipModel.forward: token embedding (process_tokens), then the layers
    changes.replace("encoder.forward", encoder, "forward", lambda own: _encoding_in_step(own, plan))


def _vocab_parallel_forward(own, plan: TEPlan):
    """ComfyUI's embedding forward on the tokens in this rank's rows (zeros for the others), summed over ranks:
    every token's row comes from exactly one rank, so the sum is the lookup itself, bit for bit."""
    start, local = plan.bounds["vocab"][STATE.env.tp_rank], plan.local("vocab", STATE.env.tp_rank)

    def forward(input_ids, *args, **kwargs):
        mine = (input_ids >= start) & (input_ids < start + local)
        rows = own((input_ids - start).clamp(0, local - 1), *args, **kwargs)
        rows = torch.where(mine.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        return all_reduce(rows.contiguous(), tp_group())

    return forward


def _encoding_in_step(original, plan: TEPlan):
    @functools.wraps(original)
    def forward(*args, **kwargs):
        try:
            agree_step(step_key("text-encode"), {"plan": plan.fingerprint(), "inputs": inputs_digest(args, kwargs)})
        except PeerLostError as e:
            raise TP2Error(
                f"{STATE.tag} the text encoder is split over the ranks and cannot run on this rank alone: {e}. Queue the "
                "prompt again (every rank's node cache is cleared first)."
            ) from e
        t0 = time.monotonic()
        with in_step(), role_guard():  # an interrupt waits for the end of the encode, on every rank
            out = original(*args, **kwargs)
        log.info("%s text encode over %d ranks: %.2f s", STATE.tag, plan.tp_size, time.monotonic() - t0)
        return out

    return forward


def inputs_digest(args, kwargs) -> str:
    """One digest of every tensor the encoder is given, at any depth (the embeddings, vision features, masks)."""
    parts: list[str] = []

    def walk(v) -> None:
        if isinstance(v, torch.Tensor):
            parts.append(f"{tuple(v.shape)}:{bytes_digest(v)}")
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, (int, float, str, bool)) or v is None:
            parts.append(repr(v))

    walk((args, kwargs))
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()[:16]
