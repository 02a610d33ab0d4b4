"""Interrupts under tensor parallelism: every rank must stop at the same model evaluation.

ComfyUI raises an interrupt from its progress hook after each step and from `comfy.ops.run_every_op` inside
every layer; on one rank alone either would leave the others waiting in a collective. While a TP sampler runs
(`SAMPLING.active`), both checks only keep the flag; rank 0 reads it at the next model evaluation and tells every
rank to stop there (see model_wrappers._diffusion_model). The other steps every rank runs together (the split VAE decode,
the split text encode) set the same flag through run.in_step: an interrupt during one takes effect at its end.
"""

from __future__ import annotations

import functools
import threading

import comfy.model_management as mm
import comfy.ops
import comfy.utils

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
