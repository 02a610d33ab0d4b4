"""Parallel H3 video VAE decode: the tile decodes of one video decode are spread over the TP ranks.

ComfyUI's `MiniMaxH3VideoVAE.decode_temporal` decodes latent chunks in turn, each in spatial tiles (one costly,
independent `_decode_pixels` call per tile), then blends. Rank r decodes its tiles of ComfyUI's order and broadcasts
each (tp2.chunk_decode), so ComfyUI's own tiling and blends run unchanged on every rank: the single-rank video bit for
bit. Decodes on this rank alone, logged: TP2_PARALLEL_VAE=0, tp_size 1, one chunk, or a peer not at the decode within
TP2_PROMPT_TIMEOUT_S. An OOM in a tile is a TP2Error (ComfyUI's one-rank OOM retry would strand the others).
"""

from __future__ import annotations

import functools
import time

import comfy.model_management as mm
import torch

from ..tp2 import settings
from ..tp2.chunk_decode import RoundRobinDecoder
from ..tp2.errors import PeerLostError, TP2Error
from ..tp2.same_bytes import bytes_digest
from .patches import PATCHES
from .run import agree_step, in_step, mark_progress, step_key
from .state import STATE, log

ENV_PARALLEL_VAE = "TP2_PARALLEL_VAE"


def install_parallel_vae_decode() -> None:
    if not settings.value(ENV_PARALLEL_VAE) or STATE.env.tp_size < 2:
        raw = settings.raw(ENV_PARALLEL_VAE)
        log.info("%s video VAE decode not split (%s=%s, tp_size %d)", STATE.tag, ENV_PARALLEL_VAE, raw, STATE.env.tp_size)
        return
    import comfy.ldm.minimax.vae as h3_vae

    PATCHES.install(h3_vae.MiniMaxH3VideoVAE, "decode_temporal", _hooked_decode_temporal)


def _hooked_decode_temporal(original):
    @functools.wraps(original)
    def decode_temporal(vae, z, output_buffer=None):
        pad_tokens, num_chunks = vae._decode_temporal_chunks(z.shape[2])
        if num_chunks < 2:
            log.info(
                "%s VAE decode: latent of %d frames is one chunk, nothing to split: decoding on this rank alone", STATE.tag, z.shape[2]
            )
            return original(vae, z, output_buffer)
        units = _decode_units(vae, z, pad_tokens, num_chunks)
        fields = {
            "latent_shape": str(tuple(z.shape)),
            "latent": bytes_digest(z)[:12],
            "dtype": f"{z.dtype} on {z.device.type}",
            "chunks": f"{num_chunks} x ({vae.tokens_chunk_size}+{vae.token_overlap}), pad {pad_tokens}",
            "tiles": f"{len(units)} of {tuple(units[0].shape)}",
        }
        try:
            group = agree_step(step_key("vae-decode"), fields)
        except PeerLostError as e:
            log.warning("%s %s; decoding the whole video on this rank alone (not split; may differ from the other ranks')", STATE.tag, e)
            STATE.prompt.alone = True
            return original(vae, z, output_buffer)
        return _decode_split(original, vae, z, output_buffer, num_chunks, units, group)

    return decode_temporal


def _decode_units(vae, z, pad_tokens: int, num_chunks: int):
    """Every chunk's tile inputs in the order ComfyUI's decode asks for them: `z` padded with its last token, chunk i its
    tokens [i * size, i * size + size + overlap), its tiles row by row from ComfyUI's `split_tiles`; untiled, the chunks."""
    if pad_tokens > 0:
        z = torch.cat([z, z[:, :, -1:].repeat(1, 1, pad_tokens, 1, 1)], dim=2)
    size, ratio = vae.tokens_chunk_size, vae.vae_ratio
    clips = [z[:, :, i * size : i * size + size + vae.token_overlap] for i in range(num_chunks)]
    if not vae.tiling:
        return clips
    units = []
    for clip in clips:
        ys, xs = (vae.split_tiles(n * ratio) for n in clip.shape[-2:])
        for y, h in zip(ys[0], ys[1]):
            units += [clip[..., y // ratio : y // ratio + h // ratio, x // ratio : x // ratio + w // ratio] for x, w in zip(xs[0], xs[1])]
    return units


def _decode_split(original, vae, z, output_buffer, num_chunks, units, group):
    """ComfyUI's decode_temporal with its tile decodes served by a RoundRobinDecoder."""
    decoder = RoundRobinDecoder(units, functools.partial(_local_decode, vae._decode_pixels), group, mark_progress, STATE.shares)
    own = vae.__dict__.get("_decode_pixels")  # an instance's own decode (another pack's patch) is put back after
    vae._decode_pixels = decoder.serve
    t0 = time.monotonic()
    try:
        with in_step():  # interrupts wait for the end of the decode; a failure clears every rank's cache before the next prompt
            out = original(vae, z, output_buffer)
            if decoder.served != len(units):
                raise TP2Error(
                    f"{STATE.tag} the VAE decoded {decoder.served} of {len(units)} tiles the parallel schedule made: ComfyUI's "
                    f"temporal chunking or spatial tiling changed. Set {ENV_PARALLEL_VAE}=0 and report this with your ComfyUI version."
                )
    finally:
        if own is None:
            del vae._decode_pixels
        else:
            vae._decode_pixels = own
    STATE.prompt.split_decodes += 1
    shares = "; ".join(f"rank {r}: {n}" for r, n in enumerate(decoder.units_per_rank()))
    log.info(
        "%s VAE decode split over %d ranks: %d chunks, %d tiles (%s), %.2f s",
        STATE.tag, group.tp_size, num_chunks, len(units), shares, time.monotonic() - t0,
    )  # fmt: skip
    return out


def _local_decode(decode, clip):
    """This rank's tile decode; an OOM becomes a TP2Error so ComfyUI does not retry on this rank alone."""
    try:
        return decode(clip)
    except Exception as e:
        if not mm.is_oom(e):
            raise
        raise TP2Error(
            f"{STATE.tag} out of memory decoding a VAE tile {tuple(clip.shape)} during the split decode ({e}). Free memory "
            f"(smaller resolution, or unload models) or set {ENV_PARALLEL_VAE}=0, then queue again."
        ) from e
