"""Outputs each rank computes alone (wrapped: comfy.sd.VAE.decode, VAE.decode_tiled, the video file write), made
identical on every rank before they reach an output node.

A VAE decode a rank runs alone (a one-chunk video, TP2_PARALLEL_VAE=0, the audio, a tiled retry after an
out-of-memory on one rank) equals the other ranks' only if the processes round alike, and the video encoder turns
one last-bit difference into another MP4. So after such a decode, and after a video file is written, the ranks meet
(run.agree_step), compare a SHA-256 of the bytes, and where one differs every rank takes rank 0's. A split video
decode (nodes/vae_decode.py) is identical by construction. A peer that never reaches the decode or the write (its
node cache served it) leaves this rank's output as it is, with a log line that it may differ.
"""

from __future__ import annotations

import functools
import os
import time

import comfy.sd
from comfy_api.latest import InputImpl

from ..tp2 import __version__
from ..tp2.errors import PeerLostError
from ..tp2.same_bytes import same_blob_everywhere, same_everywhere
from .faults import nudge_metadata, nudge_output
from .patches import PATCHES
from .run import agree_step, in_step, step_key, tensor_digest
from .state import STATE, log


def install_same_outputs() -> None:
    if STATE.env.tp_size < 2:
        return
    PATCHES.install(comfy.sd.VAE, "decode", functools.partial(_hooked, "decode"))
    PATCHES.install(comfy.sd.VAE, "decode_tiled", functools.partial(_hooked, "tiled decode"))
    PATCHES.install(InputImpl.VideoFromComponents, "save_to", _saved)


def _hooked(how: str, original):
    @functools.wraps(original)
    def decode(self, samples, *args, **kwargs):
        split_before = STATE.prompt.split_decodes
        out = original(self, samples, *args, **kwargs)
        # split: every tile came from the ranks' one schedule, identical; alone: a peer missed a step (logged there)
        if STATE.prompt.split_decodes > split_before or STATE.prompt.alone:
            return out
        nudge_output(STATE.env.tp_rank, out)  # tests only (TP2_TEST_NUDGE_RANKS); inert by default
        _make_same(f"{type(self.first_stage_model).__name__} {how}", samples, out)
        return out

    return decode


def _make_same(stage: str, samples, out) -> None:
    fields = {"latent": f"{tuple(samples.shape)}:{tensor_digest(samples)}", "output": f"{tuple(out.shape)} {out.dtype}"}
    group = _meet("decoded", stage, fields, f"{stage} output")
    if group is None:
        return
    t0 = time.monotonic()
    with in_step():
        differ = same_everywhere(out, group)
    _log_compared(stage, differ, t0, "decoded", "output")


def _saved(original):
    @functools.wraps(original)
    def save_to(self, path, *args, **kwargs):
        nudge_metadata(STATE.env.tp_rank, kwargs)  # tests only (TP2_TEST_NUDGE_RANKS); inert by default
        out = original(self, path, *args, **kwargs)
        if isinstance(path, (str, os.PathLike)) and not STATE.prompt.alone:
            _make_file_same(os.fspath(path))
        return out

    return save_to


def _make_file_same(path: str) -> None:
    """Every rank's file at `path` (each rank its own output folder) ends as rank 0's bytes."""
    group = _meet("saved", "video file", {}, "video file")
    if group is None:
        return
    t0 = time.monotonic()
    with in_step():
        with open(path, "rb") as f:
            blob, differ = same_blob_everywhere(f.read(), group)
        if differ and group.tp_rank != 0:
            with open(path + ".tp2-part", "wb") as f:
                f.write(blob)
            os.replace(path + ".tp2-part", path)
    _log_compared("video file", differ, t0, "wrote", "file")


def _meet(kind: str, stage: str, fields: dict[str, str], what: str):
    """Every rank at this prompt's next `kind` step agrees on `fields` (with the pack version, the prompt and the
    stage): the group, or None when a peer never came (this rank's `what` is kept, logged as possibly different)."""
    fields = {"pack_version": __version__, "prompt": STATE.prompt.fingerprint, "stage": stage, **fields}
    try:
        return agree_step(step_key(kind), fields)
    except PeerLostError as e:
        log.warning("%s %s: this rank's %s is kept, and may differ from the other ranks'", STATE.tag, e, what)
        STATE.prompt.alone = True
        return None


def _log_compared(stage: str, differ: list[int], t0: float, verb: str, what: str) -> None:
    if differ:
        log.warning(
            "%s %s: rank(s) %s %s other bytes than rank 0; every rank now has rank 0's %s (%.2f s)",
            STATE.tag, stage, ", ".join(map(str, differ)), verb, what, time.monotonic() - t0,
        )  # fmt: skip
    else:
        log.info("%s %s: the same bytes on every rank (checked in %.2f s)", STATE.tag, stage, time.monotonic() - t0)
