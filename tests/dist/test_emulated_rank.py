"""The link emulator's rank issues what real TP2 moves: two real gloo ranks run an H3 block (tests/dist/h3_block.py on
the tiny int8 checkpoint, the row-parallel layers through tp2.layers) and sequence parallelism's pair (an all-gather,
then the row-parallel reduce-scatter to a RowLayout), their collectives recorded on the way to torch.distributed;
then rank 0 alone under scripts/bench/link_emulator.py runs the same. The same collectives in the same order: op,
shape, dtype, bytes, call site, and what was issued before each wait. Both code paths of tp2.collectives: gloo's (the
group as it is) and NCCL's (reduce_scatter_tensor, all_gather_into_tensor, TP2_OVERLAP's 4 chunks; gloo carries it)."""

from __future__ import annotations

import torch
from h3_block import block_forward, tp_linears, weight_from_state_dict
from harness import run_ranks, values

ROWS = 24
BACKENDS = ("gloo", "nccl")


def _step(tp, shard, x, t_emb) -> None:
    """An H3 block, then this rank's rows of out_proj's input gathered and out_proj reduce-scattered back to them."""
    from kernels import select_int8_gemm
    from tp2.collectives import start_all_gather_rows
    from tp2.layers import row_parallel
    from tp2.sequence_layout import RowLayout

    sd, plan, gemm = shard.state_dict, shard.plan, select_int8_gemm("eager")
    block = plan.prefix + "blocks.0."
    block_forward(x, t_emb, tp_linears(plan, sd, "blocks.0", tp, gemm), sd, block, plan.head_dim, plan.adaln_form == "full")
    out_proj = weight_from_state_dict(sd, block + "attn.out_proj.")
    layout = RowLayout.plan(ROWS, tp.tp_size, tp.tp_rank)
    local = torch.randn(layout.m, out_proj.qdata.shape[1], generator=torch.Generator().manual_seed(tp.tp_rank))
    rows = start_all_gather_rows(local, tp).result()[:ROWS]
    row_parallel(rows, out_proj, None, tp, gemm, torch.float32, None, layout)


def _recorded(tp, shard, x, t_emb, tp_rank: int, link) -> dict:
    """{backend: the key of every collective _step issued} on `tp`, its collectives over `link` (None: the real group's)."""
    from scripts.bench.link_emulator import EmulatedDist, collectives_through, present
    from tp2 import collectives

    out = {}
    for backend in BACKENDS:
        records = []
        with collectives_through(collectives, EmulatedDist(tp_rank, 2, link, records, collectives.__file__)):
            _step(present(tp, backend), shard, x, t_emb)
        out[backend] = [c.key() for c in records]
    return out


def _real_rank(tp_rank, tp_size, ckpt, x, t_emb):
    from tp2.collectives import init_tp_group
    from tp2.rank_cache import open_rank_shard
    from tp2.settings import read_tp_env

    shard = open_rank_shard(ckpt, tp_rank, tp_size)
    return _recorded(init_tp_group(read_tp_env()), shard, x, t_emb, tp_rank, None)


def test_an_emulated_rank_issues_what_real_tp2_moves(tiny_int8):
    from scripts.bench.link_emulator import Link, lone_rank
    from tp2 import collectives
    from tp2.checkpoint import CheckpointLayout
    from tp2.rank_cache import open_rank_shard

    layout = CheckpointLayout.from_file(tiny_int8)
    hidden, t_dim = layout.tensors["video_patch_proj.weight"][1][0], layout.tensors["blocks.0.adaln_proj.linear.weight"][1][1]
    g = torch.Generator().manual_seed(0)
    x, t_emb = torch.randn(ROWS, hidden, generator=g), torch.randn(2, t_dim, generator=g)
    real = values(run_ranks(_real_rank, 2, tiny_int8, x, t_emb, timeout_s=60))
    alone = lone_rank(collectives, 0, 2, torch.device("cpu"))
    emulated = _recorded(alone, open_rank_shard(tiny_int8, 0, 2), x, t_emb, 0, Link(100.0))
    assert emulated == real[0] == real[1]
    nccl = emulated["nccl"]
    assert [op for op, *_ in nccl] == ["all_reduce"] * 8 + ["all_gather"] + ["reduce_scatter"] * 4  # out_proj, fc2: 4 chunks each
    assert [waited for *_, waited in nccl[:4]] == [3, 2, 1, 0]  # every chunk started before the first is waited for
    assert sum(nbytes for op, _, _, nbytes, *_ in nccl if op == "all_reduce") == 2 * ROWS * hidden * 4  # two fp32 sums of the block
    assert {site.split(" ")[1] for *_, site, _ in nccl} == {"reduced", "_step"}
    assert [op for op, *_ in emulated["gloo"]] == ["all_reduce", "all_reduce", "all_gather", "all_reduce"]  # no chunks
