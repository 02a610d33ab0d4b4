"""The steps of a run (one prompt on every rank): the rendezvous each TP step starts with, and leaving a run.

The sampler (nodes/model_wrappers.py), the split decode (vae_decode.py) and the split encode (text_encoder.py) are
the steps; each counts the same on every rank, so their keys match.
"""

from __future__ import annotations

import contextlib

import comfy.model_management as mm

from ..tp2 import __version__
from ..tp2.errors import PeerLostError, PromptAbortedError
from ..tp2.watch import describe_failure, with_advice
from .interrupts import SAMPLING
from .state import STATE


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
        group = session.agree(key, fields, STATE.prompt_timeout_s, abort=rank0_abort if STATE.env.tp_rank == 0 else None)
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
    every rank, and a failure in it is this rank's to tell every rank (leave_run; at the sampling step `at()` names),
    an out-of-memory error led by the capacity `advice` where there is one."""
    was_sampling = getattr(SAMPLING, "active", False)
    SAMPLING.active = True
    try:
        yield
    except BaseException as e:
        told = with_advice(e, advice)
        leave_run(told, *at())
        if told is e:
            raise
        raise told from e
    finally:
        SAMPLING.active = was_sampling


def leave_run(e: BaseException, step: int | None = None, steps: int | None = None) -> None:
    """This rank's part when a TP step (sampling, the split decode) raised `e`: a peer's stop or loss is left
    behind (that peer has told every rank, or is gone); this rank's own failure is told to every rank now (at
    sampling step `step` of `steps`, when given). A stop rank 0 ordered at a model evaluation needs no telling."""
    if isinstance(e, (PromptAbortedError, PeerLostError)):
        STATE.session.abandon_group()
    elif not (isinstance(e, mm.InterruptProcessingException) and STATE.prompt.coordinated_stop):
        STATE.session.stop_run(describe_failure(STATE.env.tp_rank, e, step, steps))
