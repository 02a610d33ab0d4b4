"""On the GPU machine only (`-m gpu`; CI has no GPU): the TP core over NCCL, one process per GPU.

TP2 vs one process on the same GPU weights: column-parallel exact, row-parallel and block >= 30 dB SQNR (the
gate of tests/dist, same reasoning), with the fp32 and the bf16 all-reduce; ranks bit-identical. And what NCCL
does when a peer dies mid-run: the survivor must not hang past its timeout.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dist"))
from h3_block import block_forward, reference_linears, tp_linears  # noqa: E402
from harness import run_ranks, values  # noqa: E402

from tp2.numerics import sqnr_db  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def _inputs(hidden, t_dim):
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, hidden, generator=g), torch.randn(2, t_dim, generator=g)


def _worker(tp_rank, tp_size, ckpt, x, t_emb, reduce_dtype):
    from kernels import select_int8_gemm
    from tp2.collectives import init_tp_group
    from tp2.rank_cache import open_rank_shard
    from tp2.settings import read_tp_env

    torch.cuda.set_device(tp_rank)
    shard = open_rank_shard(ckpt, tp_rank, tp_size)
    sd, plan = shard.state_dict, shard.plan
    sd = {k: v.cuda() for k, v in sd.items()}
    tp = init_tp_group(read_tp_env(), torch.device("cuda", tp_rank))
    lin = tp_linears(plan, sd, "blocks.0", tp, select_int8_gemm(), reduce_dtype)
    out = block_forward(x.cuda(), t_emb.cuda(), lin, sd, "blocks.0.", plan.head_dim, False)
    return {k: v.float().cpu() for k, v in out.items()}


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nccl_tp2_block_matches_one_gpu(tiny_int8, reduce_dtype):
    from safetensors.torch import load_file

    sd = {k: v.cuda() for k, v in load_file(tiny_int8).items()}
    x, t_emb = _inputs(sd["video_patch_proj.weight"].shape[0], sd["blocks.0.adaln_proj.linear.weight"].shape[1])
    ref = block_forward(x.cuda(), t_emb.cuda(), reference_linears(sd, "blocks.0."), sd, "blocks.0.", 128, False)
    outs = values(run_ranks(_worker, 2, tiny_int8, x, t_emb, reduce_dtype, timeout_s=60))
    for r, out in enumerate(outs):
        for key in ("attn_out", "mlp_out", "out"):
            db = sqnr_db(out[key], ref[key].float().cpu())
            print(f"NCCL TP2 {reduce_dtype} rank {r} {key}: SQNR {db:.1f} dB")
            assert db >= 30.0, (r, key, db)
    assert torch.equal(outs[0]["out"], outs[1]["out"])


def _sequence_parallel_worker(tp_rank, tp_size, dtype):
    from tp2.collectives import all_reduce, init_tp_group, start_all_gather_rows, start_reduce_scatter_rows
    from tp2.settings import read_tp_env

    torch.cuda.set_device(tp_rank)
    tp = init_tp_group(read_tp_env(), torch.device("cuda", tp_rank))
    g = torch.Generator().manual_seed(tp_rank)
    partial = torch.randn(14880, 512, generator=g).to("cuda", dtype)  # an H3-length sequence of partial sums
    mine = start_reduce_scatter_rows(partial.clone(), tp).result()
    return mine.cpu(), start_all_gather_rows(mine, tp).result().cpu(), all_reduce(partial.clone(), tp).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nccl_sequence_parallel_pattern_equals_all_reduce(dtype):
    """TP2_SEQUENCE_PARALLEL's collectives on NCCL: reduce-scatter then all-gather is bit-identical to all-reduce."""
    outs = values(run_ranks(_sequence_parallel_worker, 2, dtype, timeout_s=60))
    summed = outs[0][2]
    for r, (mine, whole, reduced) in enumerate(outs):
        assert torch.equal(mine, summed[7440 * r : 7440 * (r + 1)]) and torch.equal(whole, summed) and torch.equal(reduced, summed)


def _peer_stops_mid_step(tp_rank, tp_size, how):
    import uuid

    from tp2.collectives import all_reduce, broadcast_tree
    from tp2.errors import PeerLostError, PromptAbortedError
    from tp2.session import TPSession
    from tp2.settings import read_tp_env

    torch.cuda.set_device(tp_rank)
    device = torch.device("cuda", tp_rank)
    s = TPSession(read_tp_env(), device, boot_id=uuid.uuid4().hex)
    s.agree("warm-up", {"x": "1"}, timeout_s=60)
    s.watcher.start()
    s.watcher.begin("run-1")
    g = s.agree("run-1/sampler1", {"seed": "1"}, timeout_s=60)
    ones = torch.ones(1 << 20, device=device)
    all_reduce(ones.clone(), g)
    torch.cuda.synchronize()
    if tp_rank == 1:
        time.sleep(1.0)  # rank 0 is in the sampling loop below by now
        if how == "kill":
            os._exit(3)
        s.stop_run("rank 1 ran out of GPU memory at step 4 of 8 (CUDA out of memory. Tried to allocate 2.00 GiB): use fewer frames")
        time.sleep(20)
        return "stopped"
    t0 = time.monotonic()
    try:
        for _ in range(100000):  # like a sampler: GPU collectives, and a host-side broadcast per model evaluation
            all_reduce(ones.clone(), g)
            broadcast_tree({"x": ones[:8]}, g)
        return "completed?!"
    except (PromptAbortedError, PeerLostError) as e:
        kind, message, waited = type(e).__name__, str(e), time.monotonic() - t0
    s.abandon_group()
    time.sleep(15)  # the process is still here afterwards (PyTorch's watchdog does not end it)
    torch.cuda.synchronize()
    return kind, message, waited, os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_nccl_peer_failure_reaches_the_survivor_in_seconds_and_it_lives_on(how):
    """A peer that stops the run (its reason) or dies mid-step: the survivor leaves within seconds (the watcher aborts
    the NCCL communicator; the next host-side wait raises), keeps running, and PyTorch's watchdog never ends it."""
    results = run_ranks(_peer_stops_mid_step, 2, how, timeout_s=120, wall_s=180)
    status, value, secs = results[0]
    assert status == "ok", results[0]
    kind, message, waited, handling = value
    print(f"{how}: survivor raised {kind} after {waited:.1f} s: {message}")
    assert handling == "0"
    if how == "stop":
        assert kind == "PromptAbortedError" and "rank 1 ran out of GPU memory at step 4 of 8" in message and waited < 10, value
    else:
        assert waited < 30, value


@pytest.mark.parametrize("rows", [2, 333, 7440, 14880])
@pytest.mark.parametrize("n,k", [(10752, 5376), (14336, 5376), (5376, 2048)])
def test_split_int8_linear_matches_int8_linear(rows, n, k):
    """kernels.int8_split on CUDA: quantising rows here and multiplying them there gives comfy-kitchen's
    int8_linear bit for bit at H3's TP2 shapes (qkv, fc1 and a narrow K), and row blocks quantise alike."""
    import comfy_kitchen as ck

    from kernels.int8_split import split_int8_linear

    g = torch.Generator().manual_seed(rows + n)
    x = (torch.randn((rows, k), generator=g) * 2).to(torch.bfloat16).cuda()
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).cuda()
    ws = (torch.rand((n, 1), generator=g) * 1e-4 + 1e-5).cuda()
    split = split_int8_linear(x, tuple(w.shape), 256)
    assert split is not None and split.backend == "cuda"
    q, s = split.quantize(x)
    want = ck.int8_linear(x, w, ws, None, out_dtype=torch.bfloat16, convrot=True, convrot_groupsize=256)
    assert torch.equal(split.gemm(q, s, w, ws, None, torch.bfloat16), want)
    half = rows // 2
    if half >= 1:
        q0, s0 = split.quantize(x[:half])
        assert torch.equal(q0, q[:half]) and torch.equal(s0, s[:half])


def _comfy_norm_modulate(x, y, gate, w, eps, scale1, shift):
    """ComfyUI's unfused H3 sequence (addcmul_, F.rms_norm, mul_, add_) on one segment."""
    if y is not None:
        x.addcmul_(y, gate)
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps).mul_(scale1).add_(shift)


@pytest.mark.parametrize("gated", [False, True])
def test_fused_norm_modulate_matches_comfy_ops(gated):
    """kernels.norm_modulate vs ComfyUI's ops at H3's width, both against the same math in float64 from the same
    bf16 inputs: the fused kernel must be at least as accurate as ComfyUI's ops (it rounds no more often) and agree
    with them to well above int8's noise. Prints the measured figures."""
    from kernels import norm_modulate

    def sqnr(a, b):
        a, b = a.double(), b.double()
        return float(10 * torch.log10(b.pow(2).sum() / (a - b).pow(2).sum().clamp_min(1e-300)))

    g = torch.Generator().manual_seed(7)
    rows, d, eps = 7440, 5376, 1e-6
    x = (torch.randn((rows, d), generator=g) * 4).to(torch.bfloat16).cuda()
    y = (torch.randn((rows, d), generator=g)).to(torch.bfloat16).cuda() if gated else None
    vec = [(torch.randn(d, generator=g) * 0.3).to(torch.bfloat16).cuda() for _ in range(4)]
    w, scale1, shift, gate = vec[0] + 1, 1.0 + vec[1], vec[2], vec[3]
    x64 = x.double() + (y.double() * gate.double() if gated else 0)
    exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double() * scale1.double() + shift.double()
    assert norm_modulate.available(x.device, x.dtype), "the probe turned the fused norms off on this GPU"
    x_comfy = x.clone()
    comfy = _comfy_norm_modulate(x_comfy, y, gate, w, eps, scale1, shift)
    h = torch.empty_like(x)
    if gated:
        norm_modulate.norm_modulate(x, w, eps, scale1, shift, h, gate, y)
        assert sqnr(x, x_comfy) > 60.0, "the gated residual differs beyond rounding"
    else:
        norm_modulate.norm_modulate(x, w, eps, scale1, shift, h)
    fused_db, comfy_db, between = sqnr(h, exact), sqnr(comfy, exact), sqnr(h, comfy)
    print(
        f"norm/modulate (gated={gated}) vs float64: fused {fused_db:.1f} dB, ComfyUI's ops {comfy_db:.1f} dB; fused vs ComfyUI {between:.1f} dB"
    )
    assert fused_db >= comfy_db - 0.5 and between > 40.0


@pytest.mark.parametrize("s", [7440, 14880, 333])
def test_qk_norm_rope_matches_comfy_kitchen(s):
    """kernels.qk_norm_rope vs comfy-kitchen's CUDA rms_rope_split_half_ (what ComfyUI's H3 attention calls) at a
    TP2 rank's H3 shapes (28 heads of 128, rot_dim 96), in place in a qkv buffer, both against float64 from the
    same bf16 inputs: the same roundings, so at least as accurate and equal but for rare last-place flips (an fp32
    sum in another order moves the norm by an ulp; where the rotation cancels, that shows as more than an ulp of
    the small output); v untouched. Prints the figures."""
    import comfy_kitchen as ck

    from kernels import qk_norm_rope

    def sqnr(a, b):
        a, b = a.double(), b.double()
        return float(10 * torch.log10(b.pow(2).sum() / (a - b).pow(2).sum().clamp_min(1e-300)))

    g = torch.Generator().manual_seed(s)
    heads, d, pairs, eps = 28, 128, 48, 1e-6
    qkv = (torch.randn((s, 3 * heads * d), generator=g) * 3).to(torch.bfloat16).cuda()
    angles = torch.rand((s, pairs), generator=g) * 100
    c, sn = torch.cos(angles), torch.sin(angles)
    table = torch.stack([c, -sn, sn, c], dim=-1).reshape(1, s, 1, pairs, 2, 2).to(torch.bfloat16).cuda()
    qw, kw = ((torch.rand(d, generator=g) + 0.5).to(torch.bfloat16).cuda() for _ in range(2))
    x64 = qkv[:, : 2 * heads * d].double().view(s, 2, heads, d)
    n = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * torch.stack([qw, kw]).double()[None, :, None]
    f = table[0, :, 0].double()[:, None, None]  # [S, 1, 1, P, 2, 2]
    lo, hi = n[..., :pairs], n[..., pairs : 2 * pairs]
    exact = torch.cat([f[..., 0, 0] * lo + f[..., 0, 1] * hi, f[..., 1, 0] * lo + f[..., 1, 1] * hi, n[..., 2 * pairs :]], -1)
    ref = qkv.clone()
    rq, rk, _ = (t.view(1, s, heads, d) for t in ref.split(heads * d, dim=-1))
    ck.rms_rope_split_half_(rq, rk, table, qw, kw, epsilon=eps, rot_dim=2 * pairs)
    q, k, _ = (t.view(s, heads, d) for t in qkv.split(heads * d, dim=-1))
    assert qk_norm_rope.available(q, k, table)
    qk_norm_rope.rms_rope_split_half_(q, k, table, qw, kw, eps)
    torch.cuda.synchronize()
    assert torch.equal(qkv[:, 2 * heads * d :], ref[:, 2 * heads * d :]), "v changed"
    ours, theirs = qkv[:, : 2 * heads * d].view(exact.shape), ref[:, : 2 * heads * d].view(exact.shape)
    differ, total = (ours != theirs).sum().item(), ours.numel()
    ours_db, theirs_db = sqnr(ours, exact), sqnr(theirs, exact)
    print(
        f"q/k norm + rope, {s} rows: vs float64 Triton {ours_db:.2f} dB, comfy-kitchen {theirs_db:.2f} dB; {differ} of {total} "
        f"values differ, largest by {(ours.float() - theirs.float()).abs().max().item():.4f}"
    )
    assert ours_db >= theirs_db - 0.05 and differ <= 1e-3 * total
