"""Independent decode chunks spread over TP ranks: who decodes which chunk, and the exchange that hands every rank
every decoded chunk, in chunk order.

A chunked video decode (the H3 VAE's temporal tiling) decodes chunks 0..n-1 one after another and blends each
into the previous one; the decodes themselves are independent. `RoundRobinDecoder` decodes chunk i on rank
i % tp_size, a round of tp_size chunks at a time, and broadcasts each decoded chunk from its owner, so every rank
can run the model's own serial blend on exactly the tensors a single-rank decode would have made.

    clips = temporal_chunks(z, pad, n, size, overlap)   chunk inputs, cut as the H3 VAE cuts them
    dec = RoundRobinDecoder(clips, decode, tp)   decode(clip) -> decoded chunk
    dec.serve(clip)                              the next chunk's decode; `clip` must equal clips[next]

Memory: at most one round (tp_size decoded chunks) is held at a time. Imports torch only; never `comfy`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .collectives import TPGroup, broadcast_tree
from .errors import ChunkingChangedError


def temporal_chunks(z: torch.Tensor, pad_tokens: int, num_chunks: int, chunk_size: int, overlap: int) -> list[torch.Tensor]:
    """The inputs of a temporally chunked decode of `z` [B, C, T, H, W]: pad T with the last token `pad_tokens`
    times, then chunk i is tokens [i * chunk_size, i * chunk_size + chunk_size + overlap) (views, no copies)."""
    if pad_tokens > 0:
        z = torch.cat([z, z[:, :, -1:].repeat(1, 1, pad_tokens, 1, 1)], dim=2)
    return [z[:, :, i * chunk_size : i * chunk_size + chunk_size + overlap] for i in range(num_chunks)]


def chunk_owner(index: int, tp_size: int) -> int:
    """The rank that decodes chunk `index`."""
    return index % tp_size


def rank_shares(num_chunks: int, tp_size: int) -> list[list[int]]:
    """Each rank's chunk indices, in rank order."""
    return [[i for i in range(num_chunks) if chunk_owner(i, tp_size) == r] for r in range(tp_size)]


class RoundRobinDecoder:
    """Serve chunk decodes in order 0..n-1; chunk i is decoded on rank i % tp_size, then broadcast from it.

    Contract per round of tp_size chunks: forward: each rank decodes at most one chunk, then one broadcast per
    chunk from its owner (over `tp`); every rank ends the round with the same decoded tensors.
    """

    def __init__(self, clips: list[torch.Tensor], decode: Callable[[torch.Tensor], torch.Tensor], tp: TPGroup):
        self.clips, self.decode, self.tp = clips, decode, tp
        self.served = 0
        self._round: dict[int, torch.Tensor] = {}

    @property
    def done(self) -> bool:
        return self.served == len(self.clips)

    def serve(self, clip: torch.Tensor) -> torch.Tensor:
        """The decode of the next chunk, checked to be the chunk the model passes (fail closed, never a wrong video)."""
        i = self.served
        if i >= len(self.clips) or clip.shape != self.clips[i].shape or not torch.equal(clip, self.clips[i]):
            raise ChunkingChangedError(
                f"[tp2 r{self.tp.tp_rank}/{self.tp.tp_size}] the VAE asked for decode chunk {i} with input {tuple(clip.shape)}, "
                f"but the parallel schedule cut the latent into {len(self.clips)} chunks and chunk {i} differs "
                f"{'(there is none)' if i >= len(self.clips) else tuple(self.clips[i].shape)}: ComfyUI's temporal chunking "
                "changed. Set TP2_PARALLEL_VAE=0 (decode on each rank alone) and report this with your ComfyUI version."
            )
        if i % self.tp.tp_size == 0:
            self._decode_round(i)
        self.served += 1
        return self._round.pop(i)

    def _decode_round(self, start: int) -> None:
        tp, n = self.tp, len(self.clips)
        mine = start + tp.tp_rank
        local = self.decode(self.clips[mine]) if mine < n else None
        for j in range(start, min(start + tp.tp_size, n)):
            owner = chunk_owner(j, tp.tp_size)
            got = broadcast_tree(local if owner == tp.tp_rank else None, tp, src=owner)
            self._round[j] = local if owner == tp.tp_rank else got.to(self.clips[j].device)
