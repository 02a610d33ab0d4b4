"""Parallel H3 video VAE decode on real gloo groups: ComfyUI's own `MiniMaxH3VideoVAE` (imported from the
checkout, built small by tests/comfy/fixtures/h3_small_vae: 2-layer ViT decoder, random weights, fixed seed),
the pack's real hook (nodes/vae_decode.py) and session. The split decode must equal the same process's decode
without the hook exactly (torch.equal): every chunk is decoded by the same kernels from the same input, and the
blend is ComfyUI's own; so anything but bit-equality is a bug. Skipped without a ComfyUI checkout.
"""

from __future__ import annotations

import hashlib
import os
import sys

import pytest
from conftest import COMFYUI_DIR
from harness import run_ranks, values

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "comfy", "fixtures", "h3_small_vae", "__init__.py")

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(COMFYUI_DIR, "comfy", "ldm", "minimax", "vae.py")),
    reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}",
)

H_LAT, W_LAT = 17, 4  # 272 x 64 pixels: two spatial tiles (256 px) per chunk, so ComfyUI's tiled decode runs too
TILES_PER_CHUNK = 2


def _import_pack():
    """ComfyUI (CPU) and this pack as ComfyUI loads it: a package over the repository root."""
    import importlib
    import importlib.util

    os.environ["H3_TEST_SMALL_VAE"] = "1"
    sys.path.insert(0, COMFYUI_DIR)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    spec = importlib.util.spec_from_file_location("h3_small_vae", FIXTURE)
    fixture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixture)
    pack = importlib.util.module_from_spec(importlib.util.spec_from_loader("tp2pack", loader=None, is_package=True))
    pack.__path__ = [ROOT]
    sys.modules["tp2pack"] = pack
    return fixture, importlib.import_module("tp2pack.nodes.vae_decode")


def _rank(tp_rank, tp_size, lengths, extra_cases, shares=None):
    import logging

    import torch

    # one thread per rank: a CPU kernel's reduction order then cannot depend on how the OS schedules its threads, so
    # the tiles other ranks decode are bit-equal to this rank's own (CI saw a rare mismatch with 3 ranks on 2 cores)
    torch.set_num_threads(1)
    fixture, vd = _import_pack()
    import comfy.ldm.minimax.vae as h3_vae
    from tp2pack.nodes.state import STATE, Prompt
    from tp2pack.tp2.settings import read_tp_env
    from tp2pack.tp2.session import TPSession

    STATE.env, STATE.shares = read_tp_env(), shares
    STATE.session, os.environ["TP2_PROMPT_TIMEOUT_S"] = TPSession(STATE.env), "30"  # settings read unfrozen here
    STATE.prompt = Prompt("prompt-1", "prompt-1", "graph")
    messages = []
    handler = logging.Handler()
    handler.emit = lambda rec: messages.append(rec.getMessage())
    logging.getLogger("minimax_h3_tp2").addHandler(handler)
    logging.getLogger("minimax_h3_tp2").setLevel(logging.DEBUG)

    vae = h3_vae.MiniMaxH3VideoVAE().eval()
    fixture.init_weights(vae, seed=0)
    calls = []  # tile decodes this rank really ran
    original_pixels = h3_vae.MiniMaxH3VideoVAE._decode_pixels
    h3_vae.MiniMaxH3VideoVAE._decode_pixels = lambda self, z: calls.append(z.shape[2]) or original_pixels(self, z)

    def latent(t, shift=0.0):
        return torch.randn(1, 24, t, H_LAT, W_LAT, generator=torch.Generator().manual_seed(t)) + shift

    refs = {}
    with torch.no_grad():
        for t in lengths:
            refs[t] = vae.decode(latent(t))
        vd.install_parallel_vae_decode()
        out = []
        for t in lengths:
            del calls[:], messages[:]
            got = vae.decode(latent(t))
            frames = got.contiguous().numpy().tobytes()
            out.append((t, torch.equal(got, refs[t]), hashlib.sha256(frames).hexdigest(), len(calls), list(messages), got.std().item()))
        del messages[:]
        buffer = torch.empty(vae.decode_output_shape(latent(17).shape))  # ComfyUI's VAE.decode passes its own
        got = vae.decode(latent(17), output_buffer=buffer)
        out.append(("buffer", got is buffer, torch.equal(buffer, refs[17]), list(messages)))
        for case in extra_cases:
            out.append(_extra_case(case, tp_rank, vae, vd, latent, refs, messages, STATE, Prompt))
    return out


def _extra_case(case, tp_rank, vae, vd, latent, refs, messages, STATE, Prompt):
    """'mismatch': ranks hold different latents; 'alone': only rank 0 decodes (its peer never arrives)."""
    STATE.prompt = Prompt(f"prompt-{case}", f"prompt-{case}", "graph")
    del messages[:]
    if case == "mismatch":
        try:
            vae.decode(latent(17, shift=1e-3 * tp_rank))
            return case, "decoded different latents?!"
        except vd.TP2Error as e:
            return case, type(e).__name__, str(e)
    os.environ["TP2_PROMPT_TIMEOUT_S"] = "3"
    if tp_rank != 0:
        return case, "skipped"
    import torch

    return case, torch.equal(vae.decode(latent(17)), refs[17]), list(messages)


def _check(outs, tp_size, expected, shares=None):
    """Every rank: equal to the unsplit decode, byte-identical to rank 0, the tile decodes it owns and no more (a round
    of the even split: one tile each; of shares such as 3:1: rank r decodes shares[r] of each round's tiles)."""
    owners = [r for r in range(tp_size) for _ in range((shares or (1,) * tp_size)[r])]
    for r in range(tp_size):
        case, same, equal, msgs = next(o for o in outs[r] if o[0] == "buffer")
        assert same and equal, f"rank {r}: the decode did not fill the output buffer it was given with the single-process video"
    for t, chunks, fallback in expected:
        tiles = chunks * TILES_PER_CHUNK
        per_rank = [next(o for o in outs[r] if o[0] == t) for r in range(tp_size)]
        for r, (_, equal, digest, ran, msgs, std) in enumerate(per_rank):
            assert equal, f"tp_size {tp_size}, T={t}: rank {r} differs from the single-process decode"
            assert digest == per_rank[0][2]
            assert std > 0.05, "decoded frames are (nearly) constant: the test could not see a wrong chunk"
            if fallback:
                assert any("nothing to split: decoding on this rank alone" in m for m in msgs), msgs
                assert ran == tiles
            else:
                mine = [[i for i in range(tiles) if owners[i % len(owners)] == q] for q in range(tp_size)]
                assert ran == len(mine[r]), f"rank {r} ran {ran} tile decodes, its share is {mine[r]}"
                line = "; ".join(f"rank {q}: {len(s)}" for q, s in enumerate(mine))
                assert any(f"VAE decode split over {tp_size} ranks: {chunks} chunks, {tiles} tiles ({line})" in m for m in msgs), msgs


def test_split_decode_equals_single_process_two_ranks():
    # T=7: one chunk (fallback); 8: two chunks (4 pad tokens), 4 tiles; 17: three chunks, 6 tiles; 25: five, 10
    outs = values(run_ranks(_rank, 2, [7, 8, 17, 25], ["mismatch", "alone"], timeout_s=30))
    _check(outs, 2, [(7, 1, True), (8, 2, False), (17, 3, False), (25, 5, False)])
    for r in range(2):
        case, kind, msg = next(o for o in outs[r] if o[0] == "mismatch")
        assert (case, kind) == ("mismatch", "RankMismatchError") and "'latent' (rank 0: " in msg, msg
    case, equal, msgs = next(o for o in outs[0] if o[0] == "alone")
    assert equal, "rank 0 alone: the local fallback decode differs"
    assert any(
        "rank(s) 1 did not reach 'prompt-alone/vae-decode1'" in m and "decoding the whole video on this rank alone" in m for m in msgs
    ), msgs


def test_split_decode_at_shares_3_1_gives_rank_0_three_tiles_a_round():
    # T=8: four tiles (rank 0 three, rank 1 one); 17: six tiles (rank 0 five: 0, 1, 2, 4, 5)
    outs = values(run_ranks(_rank, 2, [8, 17], [], (3, 1), timeout_s=30))
    _check(outs, 2, [(8, 2, False), (17, 3, False)], (3, 1))


def test_split_decode_equals_single_process_three_ranks():
    # T=8: two chunks = four tiles on three ranks (rank 0 decodes two); 17: three chunks, six tiles; 22: four, eight
    outs = values(run_ranks(_rank, 3, [8, 17, 22], [], timeout_s=30))
    _check(outs, 3, [(8, 2, False), (17, 3, False), (22, 4, False)])
