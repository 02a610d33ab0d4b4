"""The sequence-parallel gathers: every rank's rows of an activation, in sequence order, bf16 or quantised on the
way (TP2_SP_INT8_GATHER, voted per run). `sp` is the model evaluation's SequenceParallelForward
(nodes/sequence_parallel.py): its layout and its vote.
"""

from __future__ import annotations

import torch

from ..tp2.collectives import all_reduce, start_all_gather_rows
from .parallel import Int8Rows, int8_input_split, tp_group
from .state import STATE

_votes: dict = {}  # this sampling run's int8-gather votes, by local shape


def vote_int8_gathers(block, local: torch.Tensor) -> bool:
    """Whether every rank can quantise before gathering (decided per device, so agreed over the group: a rank
    gathering int8 while its peer gathers bf16 would pair mismatched collectives). Voted at the first forward of
    each sampling run and sequence shape (the ranks agreed on the run, so they vote at the same forward), not at
    every step: the vote makes the CPU wait for the GPU."""
    run = (STATE.sampling_key, STATE.session.generation)
    if _votes.get("run") != run:
        _votes.clear()
        _votes["run"] = run
    key = (tuple(local.shape), local.dtype)
    if key not in _votes:
        can = all(int8_input_split(lin, local) is not None for lin in (block.attn.qkv_proj, block.mlp.fc1))
        against = all_reduce(torch.tensor([0.0 if can else 1.0], device=local.device), tp_group())
        _votes[key] = float(against.item()) == 0.0
    return _votes[key]


def gather(sp, local: torch.Tensor, linear=None):
    """Every rank's rows of `local` in sequence order (pad rows dropped), quantised on the way when they feed the
    int8 `linear`: a tensor, or Int8Rows that the int8 linear multiplies as they are."""
    full, group = sp.layout.full, tp_group()
    split = int8_input_split(linear, local) if sp.int8 and linear is not None else None
    if split is None:
        return start_all_gather_rows(local, group).result()[:full]
    q, scale = split.quantize(local)
    rows = start_all_gather_rows(q, group)
    scales = start_all_gather_rows(scale, group).result()
    return Int8Rows(rows.result()[:full], scales[:full], local.dtype, split)
