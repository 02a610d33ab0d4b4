"""Independent decodes spread over TP ranks: who decodes which unit, and the exchange handing every rank every decoded unit.

A chunked, tiled video decode (the H3 VAE: temporal chunks, each decoded in spatial tiles) blends each tile into its
neighbours, but the tile decodes themselves are independent. The units are every chunk's tiles in one list, in the order
the model asks for them (temporal_chunks, spatial_tiles cut them as the H3 VAE does). `RoundRobinDecoder` decodes unit i
on rank i % tp_size, a round of tp_size units at a time, and broadcasts each from its owner, so every rank runs the
model's own serial blend on exactly the tensors a single-rank decode would have made. At most one round of decoded units
is held at a time. Imports torch only; never `comfy`.
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


def spatial_tiles(clip: torch.Tensor, y_tiles: list[tuple[int, int]], x_tiles: list[tuple[int, int]], ratio: int) -> list[torch.Tensor]:
    """The latent inputs of a spatially tiled decode of `clip` [..., H, W], row by row: each tile given in pixels as
    (start, length), `ratio` pixels per latent cell (views, no copies)."""
    return [clip[..., y // ratio : y // ratio + h // ratio, x // ratio : x // ratio + w // ratio] for y, h in y_tiles for x, w in x_tiles]


def chunk_owner(index: int, tp_size: int) -> int:
    """The rank that decodes unit `index`."""
    return index % tp_size


def rank_shares(num_chunks: int, tp_size: int) -> list[list[int]]:
    """Each rank's unit indices, in rank order."""
    return [[i for i in range(num_chunks) if chunk_owner(i, tp_size) == r] for r in range(tp_size)]


class RoundRobinDecoder:
    """Serve unit decodes in order 0..n-1; unit i is decoded on rank i % tp_size, then broadcast from it.
    `mark()` is called as each round starts and as this rank's decode in it is done (tp2/progress.py).

    Contract per round of tp_size units: forward: each rank decodes at most one unit, then one broadcast per unit
    from its owner (over `tp`); every rank ends the round with the same decoded tensors.
    """

    def __init__(self, clips: list[torch.Tensor], decode: Callable[[torch.Tensor], torch.Tensor], tp: TPGroup, mark=lambda: None):
        self.clips, self.decode, self.tp, self.mark = clips, decode, tp, mark
        self.served = 0
        self._round: dict[int, torch.Tensor] = {}

    @property
    def done(self) -> bool:
        return self.served == len(self.clips)

    def serve(self, clip: torch.Tensor) -> torch.Tensor:
        """The decode of the next unit, checked to be the input the model passes (fail closed, never a wrong video)."""
        i = self.served
        if i >= len(self.clips) or clip.shape != self.clips[i].shape or not torch.equal(clip, self.clips[i]):
            raise ChunkingChangedError(
                f"[tp2 r{self.tp.tp_rank}/{self.tp.tp_size}] the VAE asked for decode {i} with input {tuple(clip.shape)}, "
                f"but the parallel schedule cut the latent into {len(self.clips)} decodes and decode {i} differs "
                f"{'(there is none)' if i >= len(self.clips) else tuple(self.clips[i].shape)}: ComfyUI's temporal chunking or "
                "spatial tiling changed. Set TP2_PARALLEL_VAE=0 (decode on each rank alone) and report this with your ComfyUI version."
            )
        if i % self.tp.tp_size == 0:
            self._decode_round(i)
        self.served += 1
        return self._round.pop(i)

    def _decode_round(self, start: int) -> None:
        tp, n = self.tp, len(self.clips)
        mine = start + tp.tp_rank
        self.mark()
        local = self.decode(self.clips[mine]) if mine < n else None
        self.mark()  # every rank marks as often, tile or none: one behind after this is still decoding
        for j in range(start, min(start + tp.tp_size, n)):
            owner = chunk_owner(j, tp.tp_size)
            got = broadcast_tree(local if owner == tp.tp_rank else None, tp, src=owner)
            self._round[j] = local if owner == tp.tp_rank else got.to(self.clips[j].device)
