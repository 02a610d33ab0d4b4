"""LoRAs on a TP model: ComfyUI's own loaders, with each patch cut to this rank's shard.

`comfy.sd.load_lora_for_models` (LoraLoader, LoraLoaderModelOnly, ...) runs unchanged, then the patches it added to
a TP H3 model are replaced by this rank's slices (tp2.lora), tagged with the LoRA's content digest; ComfyUI patches
the weights as always (int8: dequantise, add, requantise). Refused: bypass-mode LoRA (its hooks would add a full-width
update to a sharded layer), a LoRA on a sliced tensor of the split text encoder, and (lora_patch_report, before
sampling) any patch on a sharded weight not sliced here.
"""

from __future__ import annotations

import functools
import hashlib

import comfy.sd
import comfy.weight_adapter as weight_adapter

from ..tp2.errors import AdapterPlacementError
from ..tp2.lora import slice_like_weight, slice_lora_factors, state_dict_digest, unmatched_warning
from ..tp2.plan import RANK0, SPLIT, WHOLE, Plan, TensorShard
from .patches import PATCHES
from .state import STATE, log

MODEL_PREFIX = "diffusion_model."
PLAN_ATTR = "tp2_plan"  # set on the BaseModel of a TP H3 model by the loader
TE_PLAN_ATTR = "tp2_te_plan"  # set on the cond_stage_model of a split text encoder (nodes/text_encoder.py)
_SOURCE = "tp2_source"  # tag on a patch value this module produced: the LoRA digest


class _TaggedPatch(tuple):
    """A ComfyUI tuple patch ("diff"/"set", data) that can remember which LoRA it came from."""


def tp_plan(patcher) -> Plan | None:
    """The plan of a TP H3 model (None for any other model, or tp_size 1)."""
    plan = getattr(getattr(patcher, "model", None), PLAN_ATTR, None)
    return plan if plan is not None and plan.tp_size > 1 else None


def _sharded(plan: Plan, key: str) -> TensorShard | None:
    """The shard of the model weight a patch key names if ranks hold different data for it (split, rank-0 bias), else None."""
    ts = plan.tensors.get(plan.prefix + key[len(MODEL_PREFIX) :]) if key.startswith(MODEL_PREFIX) else None
    return ts if ts is not None and ts.kind in (SPLIT, RANK0) else None


def _slice_value(v, ts: TensorShard, key: str):
    """This rank's version of one patch value on a sharded tensor; AdapterPlacementError when it has none."""
    rank = STATE.env.tp_rank
    if isinstance(v, weight_adapter.LoRAAdapter):
        up, down, alpha, mid, dora_scale, reshape = v.weights
        if mid is not None or dora_scale is not None or reshape is not None:
            what = "DoRA (its magnitude is normalised over the full weight)" if dora_scale is not None else "a conv/reshaped LoRA"
            raise AdapterPlacementError(f"{key}: {what} cannot be sliced for tensor parallelism")
        up, down = slice_lora_factors(up, down, ts, rank, key)
        return weight_adapter.LoRAAdapter(v.loaded_keys, (up, down, alpha, mid, dora_scale, reshape))
    if isinstance(v, weight_adapter.WeightAdapterBase):
        raise AdapterPlacementError(f"{key}: a {type(v).__name__} patch (product of factors) cannot be sliced for tensor parallelism")
    if isinstance(v, tuple) and len(v) in (1, 2):
        kind, data = ("diff", v) if len(v) == 1 else v
        if kind in ("diff", "set") and isinstance(data, tuple) and (kind == "set" or len(data) == 1):
            return _TaggedPatch((kind, (slice_like_weight(data[0], ts, rank, key),)))
    raise AdapterPlacementError(f"{key}: a patch of type {type(v).__name__} {str(v)[:40]!r} cannot be sliced for tensor parallelism")


def shard_new_patches(before: dict, patcher, plan: Plan, source: str) -> None:
    """Replace the patches added since `before` (key -> count) by this rank's slices; refuse all-or-nothing."""
    refused, replaced = [], {}
    for key, entries in patcher.patches.items():
        ts = _sharded(plan, key)
        for i in range(before.get(key, 0), len(entries)):
            strength, v, strength_model, offset, function = entries[i]
            if ts is None:
                _tag(v, source)
                continue
            try:
                if offset is not None:
                    raise AdapterPlacementError(f"{key}: an offset patch cannot be sliced for tensor parallelism")
                replaced[(key, i)] = (strength, _tag(_slice_value(v, ts, key), source), strength_model, offset, function)
            except AdapterPlacementError as e:
                refused.append(str(e))
    if refused:
        raise AdapterPlacementError(
            f"{STATE.tag} this LoRA has {len(refused)} key(s) the TP plan cannot place:\n  "
            + "\n  ".join(refused[:12])
            + ("\n  ..." if len(refused) > 12 else "")
            + "\nUse a plain LoRA (up/down factors) for these layers, or run without TP."
        )
    for (key, i), entry in replaced.items():
        patcher.patches[key][i] = entry


def _tag(v, source: str):
    """`v`, marked as a patch of the LoRA `source` where it can carry a mark (an adapter, or a patch sliced here)."""
    if isinstance(v, (weight_adapter.WeightAdapterBase, _TaggedPatch)):
        setattr(v, _SOURCE, source)
    return v


def lora_patch_report(patcher, plan: Plan) -> str:
    """Digest of the weight patches the ranks must agree on (LoRA identity, strengths, keys). Raises
    AdapterPlacementError when a sharded weight carries a patch that was not sliced by this module."""
    unsliced = []
    h = hashlib.sha256()
    for key in sorted(patcher.patches):
        for strength, v, strength_model, offset, _fn in patcher.patches[key]:
            source = getattr(v, _SOURCE, None)
            if source is None and _sharded(plan, key):
                unsliced.append(f"{key} ({type(v).__name__})")
            h.update(f"{key}|{strength}|{strength_model}|{offset}|{source or type(v).__name__}\n".encode())
    for hook_patches in patcher.hook_patches.values():
        unsliced += [f"{key} (hook patch)" for key in hook_patches if _sharded(plan, key)]
    if unsliced:
        raise AdapterPlacementError(
            f"{STATE.tag} {len(unsliced)} sharded weight(s) carry patches that were not sliced for this rank: "
            f"{', '.join(unsliced[:6])}{' ...' if len(unsliced) > 6 else ''}. Under TP, apply LoRAs with LoraLoader or "
            "LoraLoaderModelOnly (hook LoRAs, bypass LoRAs and model merges of sharded layers are not supported)."
        )
    return h.hexdigest()[:16]


def refuse_sliced_te_patches(before: dict, clip, te_plan) -> None:
    """A LoRA on the split text encoder is refused where it touches a sliced tensor: ComfyUI would skip a
    full-shape patch on a rank's slice with a warning, so TP would silently run without the LoRA's effect."""
    for key, patches in clip.patcher.patches.items():
        name = key.split(".transformer.", 1)[-1]
        ts = te_plan.tensors.get(name)
        if len(patches) > before.get(key, 0) and ts is not None and ts.kind != WHOLE:
            raise AdapterPlacementError(
                f"{STATE.tag} a LoRA patches the text encoder's '{name}', which is split over the ranks; the pack does not "
                "slice text-encoder LoRAs. Set the LoRA's strength_clip to 0 (or use LoraLoaderModelOnly), or run with --tp-size 1."
            )


def _wrap_load_lora(original):
    @functools.wraps(original)
    def load_lora_for_models(model, clip, lora, strength_model, strength_clip, *args, **kwargs):
        plan, te_plan = tp_plan(model), getattr(getattr(getattr(clip, "patcher", None), "model", None), TE_PLAN_ATTR, None)
        if plan is None and te_plan is None:
            return original(model, clip, lora, strength_model, strength_clip, *args, **kwargs)
        clip_before = {k: len(v) for k, v in clip.patcher.patches.items()} if clip is not None else {}
        before = {k: len(v) for k, v in model.patches.items()} if plan is not None else {}
        new_model, new_clip = original(model, clip, lora, strength_model, strength_clip, *args, **kwargs)
        if te_plan is not None and new_clip is not None:
            refuse_sliced_te_patches(clip_before, new_clip, te_plan)
        if plan is None:
            return new_model, new_clip
        source = state_dict_digest(lora)
        shard_new_patches(before, new_model, plan, source)
        added = sum(len(v) for v in new_model.patches.values()) - sum(before.values())
        log.info("%s LoRA %s at strength %s: %d patches, sliced for rank %d", STATE.tag, source, strength_model, added, STATE.env.tp_rank)
        te_added = sum(len(v) for v in new_clip.patcher.patches.values()) - sum(clip_before.values()) if new_clip is not None else 0
        if (warning := unmatched_warning(lora.keys(), added + te_added)) is not None:
            tell_node(f"LoRA {source}: {warning}")
        return new_model, new_clip

    return load_lora_for_models


def tell_node(text: str) -> None:
    """A warning in the log, on the executing node in the web UI (ComfyUI's progress text) and, at the prompt's end, in
    its history and to its client (nodes/prompt_lifecycle.py: the web UI toasts it, tp2-submit prints it)."""
    from comfy_execution.utils import get_executing_context
    from server import PromptServer

    log.warning("%s %s", STATE.tag, text)
    context = get_executing_context()
    if context is not None and PromptServer.instance is not None:
        PromptServer.instance.send_progress_text(text, context.node_id)
    STATE.prompt.warnings.append({"node_id": getattr(context, "node_id", None), "text": text})


def _wrap_bypass(original):
    @functools.wraps(original)
    def load_bypass_lora_for_models(model, clip, lora, strength_model, strength_clip, *args, **kwargs):
        if tp_plan(model) is not None and strength_model != 0:
            raise AdapterPlacementError(
                f"{STATE.tag} bypass-mode LoRA is not supported on a tensor-parallel model (its forward hooks would add a "
                "full-width update to sharded layers). Use LoraLoaderModelOnly: it patches each rank's slice."
            )
        return original(model, clip, lora, strength_model, strength_clip, *args, **kwargs)

    return load_bypass_lora_for_models


def install_lora_hooks() -> None:
    """Both loaders are looked up as `comfy.sd.<name>` at call time by ComfyUI's nodes."""
    PATCHES.install(comfy.sd, "load_lora_for_models", _wrap_load_lora)
    PATCHES.install(comfy.sd, "load_bypass_lora_for_models", _wrap_bypass)
