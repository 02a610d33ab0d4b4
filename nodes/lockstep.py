"""Lockstep between ranks: one run per prompt, rendezvous at every sampler, rank 0's inputs broadcast to every forward.

    track_prompts()        each prompt is a run every rank knows by one id: rank 0 dispatches it to the followers
                           as it starts (front door on), with whether every rank clears its node cache first; a
                           rank whose prompt fails for any reason tells every rank at once, with its reason
                           (tp2/watch.py), and gives up its process group
    OUTER_SAMPLE wrapper   before any collective: ranks agree (over the store, bounded wait) on prompt, sampler
                           index, seed, sigmas, model and its weight patches (LoRA digests and strengths); a
                           process group is (re)made if needed
    step_key(kind)         the rendezvous key of this prompt's next step of a kind (the split decode, the encode)
    in_step()              a TP step every rank runs together: interrupts wait for its end, a failure is told
    refiner wrapper        rank 0's text states go to every rank before the (sharded) token refiner runs
    DIFFUSION_MODEL        rank 0's x, timestep, context and payload tensors go to every rank; the forward runs
                           under the role guard with the chosen attention backend

Node caching: the pack does not depend on caches being alike. Every rank clears its node cache before a prompt
when any rank restarted since its last prompt (boot ids in the store: a restarted rank has an empty cache) or
reported a failed rendezvous or collective; what is left (e.g. RAM-pressure eviction on one rank) is detected
at the sampler rendezvous (a bounded wait, a clear error) and cleared the same way before the next prompt.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json

import comfy.model_management as mm
import comfy.patcher_extension as pe
import execution
import torch

from ..tp2.collectives import broadcast_tree, carries_tensors
from ..tp2.errors import PeerLostError, PromptAbortedError
from ..tp2.handshake import model_fingerprint, prompt_details
from ..tp2.plan import Plan
from ..tp2.session import detail_key
from ..tp2.watch import describe_failure
from . import front_door
from .attention_choice import attention_override
from .capacity_check import check_capacity, sampling_peak
from .faults import inject_fault
from .interrupts import SAMPLING
from .lora import lora_patch_report
from .parallel import role_guard
from .patches import PATCHES
from .sequence_parallel import SP_FORWARD, SequenceParallelForward
from .state import STATE, log

KEY = "minimax_h3_tp2"


class _Prompt:
    """The prompt this ComfyUI is executing (the prompt worker runs one at a time)."""

    prompt_id: str | None = None
    run: str | None = None  # the id every rank knows this execution by
    fingerprint: str = "none"
    details: str = "{}"  # tp2.handshake.prompt_details: what a mismatch message names
    samplers: int = 0
    model_calls: int = 0
    transformer_options: dict | None = None  # the last model evaluation's (its sigmas give the sampling step)
    coordinated_stop: bool = False  # rank 0 told every rank to stop at this model evaluation
    cache_epoch_seen: int = 0
    boots_seen: list | None = None


CURRENT = _Prompt()


class _Steps:
    """Steps of each kind within the running prompt (every rank counts the same steps, so keys match)."""

    prompt_id: str | None = None
    counts: dict[str, int] = {}


STEPS = _Steps()


def step_key(kind: str) -> str:
    """The rendezvous key of this prompt's next `kind` step, e.g. '<run>/vae-decode2'."""
    if STEPS.prompt_id != CURRENT.prompt_id:
        STEPS.prompt_id, STEPS.counts = CURRENT.prompt_id, {}
    STEPS.counts[kind] = STEPS.counts.get(kind, 0) + 1
    return f"{CURRENT.run or 'no-prompt'}/{kind}{STEPS.counts[kind]}"


@contextlib.contextmanager
def in_step():
    """A TP step every rank runs together outside sampling (the split decode, the encode): an interrupt waits for its
    end on every rank, and a failure in it is this rank's to tell every rank (leave_run)."""
    was_sampling = getattr(SAMPLING, "active", False)
    SAMPLING.active = True
    try:
        yield
    except BaseException as e:
        leave_run(e)
        raise
    finally:
        SAMPLING.active = was_sampling


def prompt_fingerprint(prompt: dict) -> str:
    return hashlib.sha256(json.dumps(prompt, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cache_epoch(bump: bool = False) -> int | None:
    return STATE.session.cache_epoch(bump) if STATE.session is not None else None


def _caches_may_differ() -> bool:
    """True when, since this rank's last prompt, a rank restarted (new boot id: empty node cache) or a rank
    reported a failed rendezvous or collective (cache epoch bumped)."""
    changed = False
    epoch = _cache_epoch()
    if epoch is not None and epoch > CURRENT.cache_epoch_seen:
        changed, CURRENT.cache_epoch_seen = True, epoch
    boots = STATE.session.boot_ids() if STATE.session is not None else None
    if boots is not None:
        # a restart is a known id replaced by another; a first registration (None -> id) is not
        seen = CURRENT.boots_seen or [None] * len(boots)
        if any(old is not None and new is not None and old != new for old, new in zip(seen, boots)):
            changed = True
        CURRENT.boots_seen = [new if new is not None else old for old, new in zip(seen, boots)]
    return changed


def track_prompts() -> None:
    PATCHES.install(execution.PromptExecutor, "execute_async", _tracking_execute_async)


def _tracking_execute_async(original):
    @functools.wraps(original)
    async def execute_async(self, prompt, prompt_id, extra_data={}, execute_outputs=[]):  # noqa: B006 - ComfyUI's signature
        session, door = STATE.session, front_door.FRONT_DOOR
        refused, boots = None, {}
        if door is not None and STATE.env.tp_rank == 0:
            reset = _caches_may_differ()
            run, refused = await door.dispatch(prompt, prompt_id, extra_data, execute_outputs, reset)
        elif door is not None:
            order = door.take_order(prompt_id) or {"run": prompt_id, "reset": _caches_may_differ()}
            run, reset = order["run"], order["reset"]
            boots = {0: order["boot"]} if "boot" in order else {}
        else:  # no front door: every rank was given the prompt under one id
            run, reset = prompt_id, _caches_may_differ()
        if reset:
            log.info("%s a rank restarted, failed or freed memory since the last prompt: clearing this rank's node cache", STATE.tag)
            self.reset()
        CURRENT.prompt_id, CURRENT.run, CURRENT.fingerprint = prompt_id, run, prompt_fingerprint(prompt)
        CURRENT.details = prompt_details(prompt)
        CURRENT.samplers = CURRENT.model_calls = 0
        CURRENT.transformer_options = None
        CURRENT.coordinated_stop = False
        session.begin_run(run, boots)
        try:
            if refused:
                why = f"Tensor-parallel ranks unavailable: {refused}"
                log.warning("%s prompt %s not started: %s", STATE.tag, prompt_id, why)
                _fail_before_start(self, prompt, prompt_id, extra_data, execute_outputs, why)
            else:
                await original(self, prompt, prompt_id, extra_data, execute_outputs)
        finally:
            failure = _failure(self)
            if failure is not None:
                if session.stop_reason() is None:  # this rank stopped the run: every rank is told why
                    session.stop_run(f"rank {STATE.env.tp_rank} stopped the prompt: {failure}")
                else:
                    session.abandon_group()
                _cache_epoch(bump=True)
            session.end_run()
            CURRENT.prompt_id = CURRENT.run = CURRENT.transformer_options = None

    return execute_async


def _failure(executor) -> str | None:
    """Why the prompt ComfyUI just ran failed on this rank (from its status messages), or None if it succeeded."""
    for kind, data in reversed(getattr(executor, "status_messages", [])):
        if kind == "execution_error":
            return f"{data.get('node_type')} failed: {data.get('exception_type')}: {' '.join(str(data.get('exception_message', '')).split())[:500]}"
        if kind == "execution_interrupted":
            return "interrupted"
    return None


def _fail_before_start(executor, prompt, prompt_id, extra_data, outputs, why: str) -> None:
    """Record the prompt as failed without running a node, as ComfyUI records a node's error."""
    executor.server.client_id = extra_data.get("client_id")
    executor.status_messages = []
    executor.add_message("execution_start", {"prompt_id": prompt_id}, broadcast=False)
    node_id = next(iter(outputs), None) or next(iter(prompt))
    executor.add_message("execution_error", {
        "prompt_id": prompt_id, "node_id": node_id, "node_type": prompt[node_id].get("class_type", "?"), "executed": [],
        "exception_message": why, "exception_type": "TP2Error", "traceback": [], "current_inputs": {}, "current_outputs": [],
    }, broadcast=False)  # fmt: skip
    executor.success = False
    executor.history_result = {"outputs": {}, "meta": {}}


def tensor_digest(t) -> str:
    """A short content hash the ranks compare (values as fp32; non-tensors by their text)."""
    if not isinstance(t, torch.Tensor):
        return str(t)
    return hashlib.sha256(t.detach().float().cpu().numpy().tobytes()).hexdigest()[:12]


def install_lockstep(patcher, plan: Plan, checkpoint_fp: str, sequence_parallel: bool = False) -> None:
    """Wire one loaded TP model: wrappers on the patcher, the refiner broadcast on the model instance.
    `sequence_parallel`: whether this model's blocks run the sequence-parallel forward (compared across ranks)."""
    model_fields = {
        **model_fingerprint(plan.fingerprint(), checkpoint_fp, plan.tp_size),
        "reduce_dtype": str(STATE.reduce_dtype),  # an all-reduce needs one dtype on every rank
        "sequence_parallel": (  # the collectives (and the norm kernels) differ
            f"{sequence_parallel}, pieces {STATE.sp_pieces}, int8 gathers {STATE.sp_int8_gather}, fused norm {STATE.sp_fused_norm}"
        ),
    }
    patcher.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, KEY, functools.partial(_outer_sample, plan, model_fields))
    patcher.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, KEY, _diffusion_model)
    dm = patcher.model.diffusion_model
    dm.preprocess_text_embeds = functools.partial(_refine_text, type(dm).preprocess_text_embeds.__get__(dm))


def _outer_sample(plan, model_fields, executor, *args, **kwargs):
    session = STATE.session
    CURRENT.samplers += 1
    n = CURRENT.samplers
    seed = args[7] if len(args) > 7 else kwargs.get("seed")
    sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
    patches = lora_patch_report(executor.class_obj.model_patcher, plan)  # LoRA identities and strengths
    fields = dict(model_fields, prompt=CURRENT.fingerprint, sampler=str(n), seed=str(seed), sigmas=tensor_digest(sigmas), patches=patches)
    fields[detail_key("prompt")] = CURRENT.details  # names the node and input when the prompts differ
    key = f"{CURRENT.run or 'no-prompt'}/sampler{n}"
    inject_fault(STATE.env.tp_rank, 0)  # tests only (TP2_TEST_FAULT); inert by default
    latent_shapes = args[8] if len(args) > 8 else kwargs.get("latent_shapes")
    check_capacity(plan, latent_shapes, STATE.device, executor.class_obj.model_patcher)  # before the ranks meet
    session.agree(key, fields, STATE.prompt_timeout_s, abort=rank0_abort if STATE.env.tp_rank == 0 else None)
    STATE.last_agreement = f"{key}: ok (process group generation {session.generation})"
    STATE.sampling_key = key
    SAMPLING.active = True
    try:
        with sampling_peak(STATE.device):
            return executor(*args, **kwargs)
    except BaseException as e:
        leave_run(e, *_step_of(CURRENT.transformer_options))
        raise
    finally:
        SAMPLING.active = False


def leave_run(e: BaseException, step: int | None = None, steps: int | None = None) -> None:
    """This rank's part when a TP step (sampling, the split decode) raised `e`: a peer's stop or loss is left
    behind (that peer has told every rank, or is gone); this rank's own failure is told to every rank now (at
    sampling step `step` of `steps`, when given). A stop rank 0 ordered at a model evaluation needs no telling."""
    if isinstance(e, (PromptAbortedError, PeerLostError)):
        STATE.session.abandon_group()
    elif not (isinstance(e, mm.InterruptProcessingException) and CURRENT.coordinated_stop):
        STATE.session.stop_run(describe_failure(STATE.env.tp_rank, e, step, steps))


def rank0_abort() -> str | None:
    """Why rank 0 gives up waiting for its followers: an interrupt (or a cancel of the running job) on rank 0."""
    return "interrupted on rank 0" if mm.processing_interrupted() else None


def _refine_text(original, text_states):
    """The token refiner is sharded: every rank must refine rank 0's text states, in step."""
    group = STATE.session.group
    text_states = broadcast_tree(text_states if STATE.env.tp_rank == 0 else None, group)
    with role_guard():
        return original(text_states)


def _diffusion_model(executor, x, timestep, context, transformer_options, **kwargs):
    group = STATE.session.group
    CURRENT.model_calls += 1
    CURRENT.transformer_options = transformer_options  # the step is worked out from it only when a failure names it
    inject_fault(STATE.env.tp_rank, CURRENT.model_calls)  # tests only (TP2_TEST_FAULT); inert by default
    payload = kwargs.get("minimax_payload") or {}
    shared = None
    if STATE.env.tp_rank == 0:
        if mm.processing_interrupted():  # every rank stops here, at the same model evaluation
            shared = {"stop": True}
        else:
            # every tensor input (e.g. denoise_mask, audio_denoise_mask, a list of reference latents) is rank 0's
            extra = {k: v for k, v in kwargs.items() if k != "minimax_payload" and carries_tensors(v)}
            layoutless = {k: v for k, v in payload.items() if k != "layout"}
            shared = {"x": list(x), "t": timestep, "context": context, "payload": layoutless, "extra": extra}
    shared = broadcast_tree(shared, group)
    if shared.get("stop"):
        CURRENT.coordinated_stop = True
        log.info("%s interrupted on rank 0: every rank stops at this model evaluation", STATE.tag)
        mm.interrupt_current_processing(False)
        raise mm.InterruptProcessingException()
    kwargs = dict(kwargs, **shared["extra"])
    if "minimax_payload" in kwargs:  # rank 0's tensors and values; this rank's own (identical, rebuildable) layout
        kwargs["minimax_payload"] = dict(shared["payload"], **({"layout": payload["layout"]} if "layout" in payload else {}))
    # this evaluation's own options: the attention backend, and a fresh sequence-parallel state for its blocks
    transformer_options = dict(transformer_options, **{SP_FORWARD: SequenceParallelForward()})
    override = attention_override(group.device)
    if override is not None:
        transformer_options["optimized_attention_override"] = override
    with role_guard():
        return executor(shared["x"], shared["t"], shared["context"], transformer_options, **kwargs)


def _step_of(transformer_options) -> tuple[int | None, int | None]:
    """(1-based step, steps) of the model evaluation with these options, from the sampler's sigmas; (None, None)
    when unknown. Compares tensors (a device sync on GPUs): for failure messages, not for every step."""
    if not transformer_options:
        return None, None
    try:
        schedule, sigma = transformer_options["sample_sigmas"], transformer_options["sigmas"]
        hits = (schedule == sigma.reshape(-1)[0].to(schedule)).nonzero()
        return (int(hits[0, 0]) + 1 if len(hits) else None), len(schedule) - 1
    except (KeyError, AttributeError, IndexError, TypeError, RuntimeError):
        return None, None
