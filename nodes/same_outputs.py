"""Outputs each rank computes alone, made identical on every rank: VAE decodes, and every file an output node writes
(execution.get_output_from_returns reads a node's UI output, which lists its files).

A VAE decode a rank runs alone (a one-chunk video, TP2_PARALLEL_VAE=0, the audio, a tiled retry after an
out-of-memory on one rank) equals the other ranks' only if the processes round alike; files differ for other causes
too (a video encoder, the order of a .latent's header, which safetensors takes from a per-process hash map). So after
such a decode, and after an output node wrote files to the output folder, the ranks meet (run.agree_step), compare
a SHA-256 of the bytes, and where one differs every rank takes rank 0's. A split video decode (nodes/vae_decode.py)
is identical by construction. A peer that never reaches the step (its node cache served it) leaves this rank's
output as it is, with a log line that it may differ.
"""

from __future__ import annotations

import functools
import os
import time

import comfy.sd
import execution
import folder_paths

from ..tp2.errors import PeerLostError
from ..tp2.same_bytes import bytes_digest, same_blob_everywhere, same_everywhere
from .patches import PATCHES
from .run import agree_step, in_step, step_key
from .state import STATE, log


def install_same_outputs() -> None:
    if STATE.env.tp_size < 2:
        return
    PATCHES.install(comfy.sd.VAE, "decode", functools.partial(_hooked, "decode"))
    PATCHES.install(comfy.sd.VAE, "decode_tiled", functools.partial(_hooked, "tiled decode"))
    PATCHES.install(execution, "get_output_from_returns", _files_made_same)


def _hooked(how: str, original):
    @functools.wraps(original)
    def decode(self, samples, *args, **kwargs):
        split_before = STATE.prompt.split_decodes
        out = original(self, samples, *args, **kwargs)
        # split: every tile came from the ranks' one schedule, identical; alone: a peer missed a step (logged there)
        if STATE.prompt.split_decodes > split_before or STATE.prompt.alone:
            return out
        fields = {"latent": f"{tuple(samples.shape)}:{bytes_digest(samples)[:12]}", "output": f"{tuple(out.shape)} {out.dtype}"}
        stage = f"{type(self.first_stage_model).__name__} {how}"
        _compare("decoded", stage, fields, lambda group: same_everywhere(out, group), "decoded", "output")
        return out

    return decode


def _files_made_same(original):
    @functools.wraps(original)
    def get_output_from_returns(return_values, obj):
        output, ui, has_subgraph = original(return_values, obj)
        # the files its UI output lists in the output folder (SaveImage, SaveLatent, SaveVideo, SaveAudio, ...)
        entries = [e for v in ui.values() if isinstance(v, list) for e in v if isinstance(e, dict) and "filename" in e]
        base = folder_paths.get_output_directory()
        paths = [os.path.join(base, e.get("subfolder") or "", e["filename"]) for e in entries if e.get("type") == "output"]
        if paths and not STATE.prompt.alone:
            make_same = functools.partial(_same_files, paths)
            _compare("saved", f"{type(obj).__name__} files", {"files": str(len(paths))}, make_same, "wrote", "files")
        return output, ui, has_subgraph

    return get_output_from_returns


def _same_files(paths: list[str], group) -> list[int]:
    """Every rank's files at `paths` (each rank its own output folder) end as rank 0's bytes; the ranks that differed."""
    differ = set()
    for path in paths:
        with open(path, "rb") as f:
            blob, differ_here = same_blob_everywhere(f.read(), group)
        if differ_here and group.tp_rank != 0:
            with open(path + ".tp2-part", "wb") as f:
                f.write(blob)
            os.replace(path + ".tp2-part", path)
        differ.update(differ_here)
    return sorted(differ)


def _compare(kind: str, stage: str, fields: dict[str, str], make_same, verb: str, what: str) -> None:
    """Every rank at this prompt's next `kind` step agrees on `fields` and the stage, then `make_same(group)` gives
    every rank rank 0's `what` and returns the ranks whose bytes differed (logged as `verb` other bytes)."""
    try:
        group = agree_step(step_key(kind), {"stage": stage, **fields})
    except PeerLostError as e:
        log.warning("%s %s: %s: this rank's %s is kept, and may differ from the other ranks'", STATE.tag, stage, e, what)
        STATE.prompt.alone = True
        return
    t0 = time.monotonic()
    with in_step():
        differ = make_same(group)
    if differ:
        log.warning(
            "%s %s: rank(s) %s %s other bytes than rank 0; every rank now has rank 0's %s (%.2f s)",
            STATE.tag, stage, ", ".join(map(str, differ)), verb, what, time.monotonic() - t0,
        )  # fmt: skip
    else:
        log.info("%s %s: the same bytes on every rank (checked in %.2f s)", STATE.tag, stage, time.monotonic() - t0)
