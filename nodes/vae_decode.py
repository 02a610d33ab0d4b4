"""Parallel H3 video VAE decode: the temporal chunks of one decode are spread over the TP ranks.

    install_parallel_vae_decode()   wraps comfy.ldm.minimax.vae.MiniMaxH3VideoVAE.decode_temporal (once)

ComfyUI's `decode_temporal` pads the latent with its last token, decodes chunks of tokens_chunk_size +
token_overlap tokens one after another (the spatially tiled ViT decode: the expensive part, independent per
chunk), and blends each chunk into the previous one. Here rank r decodes chunks r, r + tp_size, ... and each
decoded chunk is broadcast from its owner (tp2.chunk_decode); ComfyUI's own serial blend then runs unchanged on
every rank, on exactly the tensors a single-rank decode makes, so every rank ends with the single-rank video,
bit for bit. Each chunk ComfyUI asks for is checked against the chunk decoded for it (a changed chunking in
ComfyUI is an error, never a wrong video).

Falls back to ComfyUI's decode on this rank alone, with one log line: TP2_PARALLEL_VAE=0 or tp_size 1 (read
at start-up: no hook), fewer than 2 chunks, or a peer that does not reach the decode within
TP2_PROMPT_TIMEOUT_S (e.g. its node cache served the decode; the cache epoch is raised so the next prompt clears
the caches). Refused on every rank: different latents (RankMismatchError). A failed collective or chunk decode
mid-way marks the process group broken, raises the cache epoch and fails the prompt; an out-of-memory there is
re-raised as a TP2Error, because ComfyUI's OOM retry on one rank alone would leave the others waiting.
Interrupts take effect after the decode (the deferral used during sampling). The audio VAE is not split (not
measured: a 1-D decoder over a few seconds of audio, expected far cheaper than the video decode).
"""

from __future__ import annotations

import functools
import time

import comfy.model_management as mm

from ..tp2 import __version__, settings
from ..tp2.chunk_decode import RoundRobinDecoder, rank_shares, temporal_chunks
from ..tp2.errors import PeerLostError, TP2Error
from .lockstep import CURRENT, in_step, rank0_abort, step_key, tensor_digest
from .patches import PATCHES
from .state import STATE, log

ENV_PARALLEL_VAE = "TP2_PARALLEL_VAE"


def install_parallel_vae_decode() -> None:
    """Split H3 video decodes over the ranks from now on (unless TP2_PARALLEL_VAE=0)."""
    if not settings.value(ENV_PARALLEL_VAE) or STATE.env.tp_size < 2:
        log.info(
            "%s video VAE decode not split (%s=%s, tp_size %d)",
            STATE.tag,
            ENV_PARALLEL_VAE,
            settings.raw(ENV_PARALLEL_VAE),
            STATE.env.tp_size,
        )
        return
    import comfy.ldm.minimax.vae as h3_vae

    PATCHES.install(h3_vae.MiniMaxH3VideoVAE, "decode_temporal", _splitting_decode_temporal)


def _splitting_decode_temporal(original):
    @functools.wraps(original)
    def decode_temporal(self, z, output_buffer=None):
        return _decode_temporal(original, self, z, output_buffer)

    return decode_temporal


def _decode_temporal(original, vae, z, output_buffer):
    pad_tokens, num_chunks = vae._decode_temporal_chunks(z.shape[2])
    if num_chunks < 2:
        log.info("%s VAE decode: latent of %d frames is one chunk, nothing to split: decoding on this rank alone", STATE.tag, z.shape[2])
        return original(vae, z, output_buffer)
    key = step_key("vae-decode")
    fields = {
        "pack_version": __version__,
        "prompt": CURRENT.fingerprint,
        "latent_shape": str(tuple(z.shape)),
        "latent": tensor_digest(z),
        "dtype": f"{z.dtype} on {z.device.type}",
        "chunks": f"{num_chunks} x ({vae.tokens_chunk_size}+{vae.token_overlap}), pad {pad_tokens}",
    }
    session = STATE.session
    try:
        group = session.agree(key, fields, STATE.prompt_timeout_s, abort=rank0_abort if STATE.env.tp_rank == 0 else None)
    except PeerLostError as e:
        session.cache_epoch(bump=True)
        log.warning("%s %s; decoding the whole video on this rank alone (same result, not split)", STATE.tag, e)
        return original(vae, z, output_buffer)
    STATE.last_agreement = f"{key}: ok (process group generation {session.generation})"
    return _decode_split(
        original, vae, z, output_buffer, temporal_chunks(z, pad_tokens, num_chunks, vae.tokens_chunk_size, vae.token_overlap), group
    )


def _decode_split(original, vae, z, output_buffer, clips, group):
    """ComfyUI's decode_temporal with its chunk decodes served by a RoundRobinDecoder."""
    decoder = RoundRobinDecoder(clips, _local_decode(vae._adaptive_decode), group)
    had_own = "_adaptive_decode" in vae.__dict__
    vae._adaptive_decode = decoder.serve
    t0 = time.monotonic()
    try:
        with in_step():  # interrupts wait for the end of the decode; a failure clears every rank's cache before the next prompt
            out = original(vae, z, output_buffer)
            if not decoder.done:
                raise TP2Error(
                    f"{STATE.tag} the VAE decoded {decoder.served} of {len(clips)} chunks the parallel schedule made: ComfyUI's "
                    f"temporal chunking changed. Set {ENV_PARALLEL_VAE}=0 and report this with your ComfyUI version."
                )
    finally:
        if not had_own:
            del vae._adaptive_decode
    shares = "; ".join(f"rank {r}: {','.join(map(str, s)) or '-'}" for r, s in enumerate(rank_shares(len(clips), group.tp_size)))
    log.info(
        "%s VAE decode split over %d ranks: %d chunks (%s), %.2f s", STATE.tag, group.tp_size, len(clips), shares, time.monotonic() - t0
    )
    return out


def _local_decode(decode):
    """This rank's chunk decode; an OOM becomes a TP2Error so ComfyUI does not retry on this rank alone."""

    def run(clip):
        try:
            return decode(clip)
        except Exception as e:
            if not mm.is_oom(e):
                raise
            raise TP2Error(
                f"{STATE.tag} out of memory decoding a VAE chunk {tuple(clip.shape)} during the split decode ({e}). Free memory "
                f"(smaller resolution, or unload models) or set {ENV_PARALLEL_VAE}=0, then queue again."
            ) from e

    return run
