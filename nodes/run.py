"""The steps of a run (one prompt on every rank): the rendezvous each TP step starts with, interrupts, leaving a run.

The sampler (nodes/model_wrappers.py), the split decode (vae_decode.py) and the split encode (text_encoder.py) are
the steps; each counts the same on every rank, so their keys match. Every rank must stop at the same point of a step:
ComfyUI raises an interrupt from its progress hook after each sampling step and from `comfy.ops.run_every_op` inside
every layer, which on one rank alone would leave the others waiting in a collective. Inside a step (`in_step`,
`SAMPLING.active`) both checks only keep the flag: rank 0 reads it at the next model evaluation and tells every rank
to stop there (model_wrappers._diffusion_model); a decode or an encode takes it at its end.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import comfy.model_management as mm
import comfy.ops
import comfy.utils

from ..tp2 import __version__, settings
from ..tp2.errors import PeerLostError, PromptAbortedError
from ..tp2.watch import describe_failure, with_advice
from .patches import PATCHES
from .state import STATE, log

SAMPLING = threading.local()  # .active while a TP sampler or split decode runs in this (the prompt worker's) thread


def _deferring_update_absolute(original):
    @functools.wraps(original)
    def update_absolute(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except mm.InterruptProcessingException:
            if not getattr(SAMPLING, "active", False):
                raise
            log.debug("%s interrupt deferred to the next model evaluation", STATE.tag)
            mm.interrupt_current_processing(True)  # the check cleared it; keep it for the next model evaluation

    return update_absolute


def _deferring_run_every_op(original):
    @functools.wraps(original)
    def run_every_op():
        if not getattr(SAMPLING, "active", False):
            return original()

    return run_every_op


def install_interrupt_deferral() -> None:
    PATCHES.install(comfy.utils.ProgressBar, "update_absolute", _deferring_update_absolute)
    PATCHES.install(comfy.ops, "run_every_op", _deferring_run_every_op)


def step_key(kind: str) -> str:
    """The rendezvous key of this prompt's next `kind` step, e.g. '<run>/vae-decode2'."""
    prompt = STATE.prompt
    prompt.steps[kind] = prompt.steps.get(kind, 0) + 1
    return f"{prompt.run or 'no-prompt'}/{kind}{prompt.steps[kind]}"


def agree_step(key: str, fields: dict[str, str]):
    """Every rank agrees on `fields`, the pack version and the prompt at `key` (bounded wait; rank 0 gives up when it
    is interrupted) and the agreement is recorded for the status node; returns the process group. A peer that never
    arrives raises PeerLostError, and every rank's node cache is cleared before the next prompt (the cache epoch)."""
    session = STATE.session
    fields = {"pack_version": __version__, "prompt": STATE.prompt.fingerprint, **fields}
    try:
        group = session.agree(key, fields, settings.value("TP2_PROMPT_TIMEOUT_S"), abort=rank0_abort if STATE.env.tp_rank == 0 else None)
    except PeerLostError:
        session.cache_epoch(bump=True)
        raise
    STATE.last_agreement = f"{key}: ok (process group generation {session.generation})"
    session.watcher.progress.begin(key)  # a peer stuck in this step is named after its progress timeout (tp2/progress.py)
    return group


def mark_progress() -> None:
    """A unit of the step starts, or this rank's part of it is done (tp2/progress.py)."""
    STATE.session.watcher.progress.mark()


def rank0_abort() -> str | None:
    """Why rank 0 gives up waiting for its followers: an interrupt (or a cancel of the running job) on rank 0."""
    return "interrupted on rank 0" if mm.processing_interrupted() else None


@contextlib.contextmanager
def in_step(advice: str | None = None, at=lambda: (None, None)):
    """A TP step every rank runs together (sampling, the split decode, the encode): an interrupt waits for its end on
    every rank, and a failure in it is this rank's to tell every rank (at the sampling step `at()` names), an
    out-of-memory error led by the capacity `advice` where there is one."""
    was_sampling = getattr(SAMPLING, "active", False)
    SAMPLING.active = True
    try:
        yield
    except BaseException as e:
        told = with_advice(e, advice)
        if isinstance(told, (PromptAbortedError, PeerLostError)):  # a peer's stop or loss: it told every rank, or is gone
            STATE.session.abandon_group()
        elif not (isinstance(told, mm.InterruptProcessingException) and STATE.prompt.coordinated_stop):  # rank 0's stop: all know
            STATE.session.stop_run(describe_failure(STATE.env.tp_rank, told, *at()))  # this rank's own failure, told to every rank
        if told is e:
            raise
        raise told from e
    finally:
        SAMPLING.active = was_sampling
