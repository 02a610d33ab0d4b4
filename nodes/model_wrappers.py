"""The wrappers on a loaded TP model: the sampler's rendezvous, and rank 0's inputs at every model evaluation.

OUTER_SAMPLE      before any collective the ranks agree (over the store, bounded wait) on prompt, sampler index, seed,
                  sigmas, model and its weight patches (LoRA digests and strengths)
refiner           rank 0's text states go to every rank before the (sharded) token refiner runs
DIFFUSION_MODEL   rank 0's x, timestep, context and payload tensors go to every rank; the forward runs under the
                  role guard with the chosen attention backend
"""

from __future__ import annotations

import functools

import comfy.model_management as mm
import comfy.patcher_extension as pe
import torch
from comfy_api.torch_helpers.torch_compile import TORCH_COMPILE_KWARGS

from ..tp2 import settings
from ..tp2.collectives import broadcast_tree, carries_tensors
from ..tp2.errors import TP2Error
from ..tp2.handshake import detail_key, model_fingerprint
from ..tp2.plan import Plan
from ..tp2.same_bytes import bytes_digest
from .capacity_check import capacity_advice, sampling_peak
from .h3_attention import attention_override
from .lora import lora_patch_report
from .parallel import role_guard
from .patches import changes_of
from .run import agree_step, in_step, mark_progress, step_key
from .sequence_parallel import SP_FORWARD, SequenceParallelForward, with_last_block_gathered
from .state import STATE, log
from .status_api import resolved_settings

KEY = "minimax_h3_tp2"


def install_model_wrappers(patcher, plan: Plan, checkpoint_fp: str, sequence_parallel: bool = False) -> None:
    """Wire one loaded TP model: wrappers on the patcher, the refiner broadcast on the model instance."""
    model_fields = {
        **model_fingerprint(plan.fingerprint(), checkpoint_fp, plan.tp_size, plan.shares),
        "reduce_dtype": str(STATE.reduce_dtype),  # an all-reduce needs one dtype on every rank
        "wire": settings.value("TP2_WIRE"),  # and one wire (the collectives differ)
        "overlap": resolved_settings()["row-parallel reduce"],  # and the same chunks (TP2_OVERLAP: as many collectives)
        "compute_dtype": str(STATE.compute_dtype),  # the replicated stream too: a 2080 Ti beside a 3090 needs fp32 on both
        "sequence_parallel": (  # the collectives (and the norm kernels) differ
            f"{sequence_parallel}, int8 gathers {settings.value('TP2_SP_INT8_GATHER')}, fused norm {settings.value('TP2_SP_FUSED_NORM')}"
        ),
    }
    patcher.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, KEY, functools.partial(_outer_sample, plan, model_fields))
    patcher.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, KEY, _diffusion_model)
    dm = patcher.model.diffusion_model
    changes_of(dm).replace("preprocess_text_embeds", dm, "preprocess_text_embeds", lambda own: functools.partial(_refine_text, own))


def _outer_sample(
    plan, model_fields, executor, noise, latent_image, sampler, sigmas, denoise_mask=None, callback=None, disable_pbar=False,
    seed=None, latent_shapes=None, **kwargs,
):  # fmt: skip
    """comfy.samplers.CFGGuider.outer_sample's OUTER_SAMPLE wrapper (its arguments, by name)."""
    key = step_key("sampler")
    fields = dict(
        model_fields, sampler=str(STATE.prompt.steps["sampler"]), seed=str(seed), sigmas=bytes_digest(sigmas)[:12],
        patches=lora_patch_report(executor.class_obj.model_patcher, plan),  # LoRA identities, strengths
    )  # fmt: skip
    fields[detail_key("prompt")] = STATE.prompt.details  # names the node and input when the prompts differ
    _refuse_before_sampling(executor.class_obj)
    advice = capacity_advice(plan, latent_shapes, STATE.device, executor.class_obj.model_patcher)  # before the ranks meet
    agree_step(key, fields)
    STATE.sampling_key = key
    with in_step(advice, lambda: _step_of(STATE.prompt.transformer_options)), sampling_peak(STATE.device):
        return executor(
            noise, latent_image, sampler, sigmas, denoise_mask, callback, disable_pbar, seed, latent_shapes=latent_shapes, **kwargs
        )


def _refuse_before_sampling(guider) -> None:
    """What cannot run here under TP, refused on every rank before the ranks meet (never a failure mid-run)."""
    sequence_parallel = getattr(guider.model_patcher.model.diffusion_model.blocks[-1], "tp2_sp_last", False)
    if guider.model_options.get(TORCH_COMPILE_KWARGS) and sequence_parallel and STATE.device.type == "cpu":
        raise TP2Error(
            f"{STATE.tag} TorchCompileModel cannot run with sequence parallelism on the CPU: torch {torch.__version__}'s "
            "inductor fails generating C++ for the sequence-parallel DiT blocks (KeyError in its CPU code generator). "
            "Start the ranks without --fast (TP2_SEQUENCE_PARALLEL=0), or remove TorchCompileModel."
        )


def _refine_text(original, text_states):
    """The token refiner is sharded: every rank must refine rank 0's text states, in step."""
    text_states = broadcast_tree(text_states, STATE.session.group)
    with role_guard():
        return original(text_states)


def _diffusion_model(executor, x, timestep, context, transformer_options, **kwargs):
    args, kwargs = _rank0_inputs(executor.class_obj, x, timestep, context, transformer_options, kwargs)
    with role_guard():
        return executor(*args, **kwargs)


@torch.compiler.disable  # TorchCompileModel compiles the forward around this: the store, pickles and interrupt flag stay eager
def _rank0_inputs(dm, x, timestep, context, transformer_options, kwargs) -> tuple[tuple, dict]:
    """This model evaluation's arguments, rank 0's on every rank; raises the interrupt when rank 0 stops here."""
    group = STATE.session.group
    prompt = STATE.prompt
    prompt.model_calls += 1
    prompt.transformer_options = transformer_options  # the step is worked out from it only when a failure names it
    mark_progress()  # before rank 0's inputs are shared: a peer behind this rank from here on is waited for
    payload = kwargs.get("minimax_payload") or {}
    # every tensor input (e.g. denoise_mask, audio_denoise_mask, a list of reference latents) is rank 0's, received
    # into this rank's own tensors where rank 0 passes its own on (a wrapper inside may change them in place)
    extra = {k: v for k, v in kwargs.items() if k != "minimax_payload" and carries_tensors(v)}
    layoutless = {k: v for k, v in payload.items() if k != "layout"}
    shared = {"x": list(x), "t": timestep, "context": context, "payload": layoutless, "extra": extra}
    if STATE.env.tp_rank == 0 and mm.processing_interrupted():  # every rank stops here, at the same model evaluation
        shared = {"stop": True}
    shared = broadcast_tree(shared, group)
    if shared.get("stop"):
        prompt.coordinated_stop = True
        log.info("%s interrupted on rank 0: every rank stops at this model evaluation", STATE.tag)
        mm.interrupt_current_processing(False)
        raise mm.InterruptProcessingException()
    kwargs = dict(kwargs, **shared["extra"])
    if "minimax_payload" in kwargs:  # rank 0's tensors and values; this rank's own (identical, rebuildable) layout
        kwargs["minimax_payload"] = dict(shared["payload"], **({"layout": payload["layout"]} if "layout" in payload else {}))
    # this evaluation's own options: the attention backend (a node's own, e.g. ModelAttentionBackend's, stands: each
    # rank runs attention on its own heads), and a fresh sequence-parallel state for its blocks
    override = transformer_options.get("optimized_attention_override") or attention_override(group.device, STATE.compute_dtype)
    transformer_options = dict(transformer_options, optimized_attention_override=override)
    transformer_options[SP_FORWARD] = SequenceParallelForward()
    transformer_options = with_last_block_gathered(dm, transformer_options)
    return (shared["x"], shared["t"], shared["context"], transformer_options), kwargs


def _step_of(transformer_options) -> tuple[int | None, int | None]:
    """(1-based step, steps) of the model evaluation with these options, from the sampler's sigmas; (None, None)
    when unknown. Compares tensors (a device sync on GPUs): for failure messages, not for every step."""
    try:
        schedule, sigma = transformer_options["sample_sigmas"], transformer_options["sigmas"]
        hits = (schedule == sigma.reshape(-1)[0].to(schedule)).nonzero()
        return (int(hits[0, 0]) + 1 if len(hits) else None), len(schedule) - 1
    except (KeyError, AttributeError, IndexError, TypeError, RuntimeError):
        return None, None
