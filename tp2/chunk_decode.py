"""Independent decodes spread over TP ranks: who decodes which unit, and the exchange handing every rank every decoded unit.

A chunked, tiled video decode (the H3 VAE: temporal chunks, each decoded in spatial tiles) blends each tile into its
neighbours, but the tile decodes themselves are independent. The units are every chunk's tiles in the order the model
asks for them. `RoundRobinDecoder` decodes them a round at a time, each rank its share of the round (even split: unit i
on rank i % tp_size), and broadcasts each from its owner, so every rank blends exactly the tensors a single-rank decode
would have made. At most one round of decoded units is held at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .collectives import TPGroup, broadcast_tree
from .errors import TP2Error
from .split import Shares, even, small

MAX_ROUND_PER_RANK = 4  # uneven shares are approximated by a round of at most this many units per rank


class RoundRobinDecoder:
    """Serve unit decodes in order 0..n-1, a round at a time, each broadcast from its owner (over `tp`). `mark()` is
    called as each round starts and as this rank's decodes in it are done (tp2/progress.py)."""

    def __init__(self, clips: list[torch.Tensor], decode: Callable[[torch.Tensor], torch.Tensor], tp: TPGroup, mark, shares: Shares | None):
        self.clips, self.decode, self.tp, self.mark = clips, decode, tp, mark
        per_rank = small(shares or even(tp.tp_size), MAX_ROUND_PER_RANK)  # each rank's share of a round, in whole units
        self.owners = [r for r in range(len(per_rank)) for _ in range(per_rank[r])]  # the owner of each unit of a round
        self.served = 0
        self._round: dict[int, torch.Tensor] = {}

    def units_per_rank(self) -> list[int]:
        return [sum(self.owners[i % len(self.owners)] == r for i in range(len(self.clips))) for r in range(self.tp.tp_size)]

    def serve(self, clip: torch.Tensor) -> torch.Tensor:
        """The decode of the next unit, checked to be the input the model passes (fail closed, never a wrong video)."""
        i = self.served
        if i >= len(self.clips) or clip.shape != self.clips[i].shape or not torch.equal(clip, self.clips[i]):
            raise TP2Error(
                f"[tp2 r{self.tp.tp_rank}/{self.tp.tp_size}] the VAE asked for decode {i} with input {tuple(clip.shape)}, "
                f"but the parallel schedule cut the latent into {len(self.clips)} decodes and decode {i} differs "
                f"{'(there is none)' if i >= len(self.clips) else tuple(self.clips[i].shape)}: ComfyUI's temporal chunking or "
                "spatial tiling changed. Set TP2_PARALLEL_VAE=0 (decode on each rank alone) and report this with your ComfyUI version."
            )
        if i % len(self.owners) == 0:  # a round starts: decode this rank's units of it, then every unit from its owner
            tp, units = self.tp, range(i, min(i + len(self.owners), len(self.clips)))
            self.mark()
            local = {j: self.decode(self.clips[j]) for j in units if self.owners[j - i] == tp.tp_rank}
            self.mark()  # every rank marks as often, tiles or none: one behind after this is still decoding
            for j in units:
                got = broadcast_tree(local.get(j), tp, src=self.owners[j - i])
                self._round[j] = local[j] if j in local else got.to(self.clips[j].device)
        self.served += 1
        return self._round.pop(i)
