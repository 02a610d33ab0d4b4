"""TP2_SEQUENCE_PARALLEL=1 on real ComfyUI servers (CPU, gloo): the same latents as plain TP2.

Sequence parallelism changes where rows are normalised, modulated and summed, not the math of any row, so at
tp_size 2 the latents must be bit-identical to plain TP2 (a sum of two partials is the same in either
collective), and hence within test_tp_comfy.py's thresholds of one server. Gathering int8 linears' inputs
quantised (the default) or in bf16 gives the same bits. The sequence lengths used cover an even and an odd number
of rows (odd: the sequence ends in a zero pad row). The MLP in row chunks (TP2_SP_CHUNK_ROWS, the path at long
sequences) is bit-identical to plain TP2 where each chunk has enough rows for the CPU's BLAS to round as on the
whole matrix (19-20 rows here). Chunks of 3-4 rows compute and sum each row as before, but a BLAS may block the
sums of a smaller matrix differently: there the gate is 1e-5 relative for float weights and 40 dB SQNR for int8
(an ulp change in the float ConvRot rotation before quantisation can flip an activation's int8 rounding);
measured on CPU: see the printout. A misplaced row moves the latent by tens of percent.
"""

from __future__ import annotations

import os

import pytest
from comfy_harness import COMFYUI_DIR, have_comfyui, run_prompt, servers_for, start_ranks, stop_at_teardown, tiny_workflow
from conftest import TINY_COND, make_models
from test_tp_comfy import TP_ENV, latent, ok, rel, sqnr_db

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

COND = TINY_COND
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
INT8, FULL = "h3_tiny_int8.safetensors", "h3_tiny_full_adaln.safetensors"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(str(tmp_path_factory.mktemp("sp_models")), {INT8: ("--int8",), FULL: ("--adaln", "full")})


@pytest.fixture(scope="module")
def tp2(request, tmp_path_factory, models):
    return servers_for(request, tmp_path_factory, models, "sp_off", 2, TP_ENV)


@pytest.fixture(
    scope="module",
    params=[
        ("1", False, None),
        ("0", False, None),
        ("1", True, None),
        ("1", False, 20),
        ("0", False, 4),
    ],
    ids=["sp", "sp_bf16_gather", "sp_fused", "sp_chunks20", "sp_bf16_gather_chunks4"],
)
def tp2_sp(request, tmp_path_factory, models):
    """Sequence parallel with int8 linears' inputs gathered as int8 (default) or in bf16 (TP2_SP_INT8_GATHER=0,
    with TP2_SP_FUSED_NORM=1, which CPU ignores without a Triton device); `sp_fused`: TP2_SP_FUSED_NORM=1 run on CPU by Triton's interpreter (the
    fused norms, the q/k norm + rope kernel and the MLP residual left to the next block's norm); `..._chunksN`: the
    MLP in chunks of at most N rows (TP2_SP_CHUNK_ROWS; its default 16384 makes one chunk of every tiny sequence),
    so chunking really happens here as it does at long sequences: 20 gives chunks of 19-20 rows (the 40 and 153 rows
    of the cases below in 2 and 8 chunks), each as many rows as the CPU's fp32 BLAS needs to round every row as in
    the whole matrix (below ~13 rows it takes other kernels, measured: docs/PERFORMANCE.md), so the bytes must not
    move; 4 gives 3-4-row chunks, within the module docstring's gates."""
    int8_gather, fused, chunk_rows = request.param
    env = TP_ENV | {"TP2_SEQUENCE_PARALLEL": "1", "TP2_SP_INT8_GATHER": int8_gather}
    if chunk_rows:
        env["TP2_SP_CHUNK_ROWS"] = str(chunk_rows)
    if int8_gather == "0":  # and the fused norms asked for: on CPU they fall back to ComfyUI's ops (same bits)
        env["TP2_SP_FUSED_NORM"] = "1"
    if fused:
        env |= {"TP2_SP_FUSED_NORM": "1", "TRITON_INTERPRET": "1"}
    return servers_for(request, tmp_path_factory, models, f"sp_on_{int8_gather}_{int(fused)}_{chunk_rows}", 2, env)


def _sequence_parallel_line(server) -> str:
    with open(server.log_path, "rb") as f:
        lines = [ln for ln in f.read().decode(errors="replace").splitlines() if "sequence parallel:" in ln]
    assert lines, "the sequence-parallel forward did not run"
    return lines[-1].split("sequence parallel:")[1]


@pytest.mark.parametrize("unet,size,odd", [(INT8, (64, 64, 5), False), (INT8, (80, 80, 22), True), (FULL, (64, 64, 5), False)])
def test_sequence_parallel_equals_plain_tp2(request, tp2, tp2_sp, unet, size, odd):
    int8_gather, fused, chunk_rows = request.node.callspec.params["tp2_sp"]
    wf = tiny_workflow(unet, COND, prefix=f"sp_{unet[:-12]}_{size[0]}")
    wf["4"]["inputs"].update(width=size[0], height=size[1], length=size[2])
    sp = ok(tp2_sp, run_prompt(tp2_sp, wf))
    assert sp[0] == sp[1], "sequence-parallel ranks wrote different bytes"
    plain = ok(tp2, run_prompt(tp2, wf))
    for kind in ("video", "audio"):
        a, b = latent(sp[0], kind), latent(plain[0], kind)
        print(
            f"{unet} {size} int8 gathers {int8_gather}, fused {fused}, chunk rows {chunk_rows} {kind}: "
            f"max relative difference to plain TP2 {rel(a, b):.1e}, SQNR {sqnr_db(b, a):.1f} dB"
        )
        if fused:  # other kernels, other roundings: within the gates below, and nowhere near a misplaced row
            assert (rel(a, b) < 1e-4) if unet == FULL else (sqnr_db(b, a) >= 30.0), (kind, rel(a, b), sqnr_db(b, a))
        elif chunk_rows != 4:
            assert a.equal(b), f"{kind}: sequence parallel changed the result"
        elif unet == FULL:  # the MLP's GEMMs see 4 rows per call: the CPU BLAS may block (and sum) them differently
            assert rel(a, b) < 1e-5, (kind, rel(a, b))
        else:  # int8: the same ulp-level change in the float ConvRot rotation can flip an activation's int8 rounding
            assert sqnr_db(b, a) >= 40.0, (kind, sqnr_db(b, a))
    line = _sequence_parallel_line(tp2_sp[0])
    assert int(line.split()[0]) % 2 == int(odd), f"this case was meant to have an {'odd' if odd else 'even'} number of rows"
    gathered = "as int8" if unet == INT8 and int8_gather == "1" else "in bf16"  # float weights: nothing to quantise
    assert line.endswith(f"gathered {gathered}"), line
    assert ("norms fused (Triton)" in line) == fused, line
    chunks = int(line.split("the MLP in ")[1].split()[0])
    assert (chunks > 1) == bool(chunk_rows), line  # chunked where asked (the MLP's rows really split), else one chunk


@pytest.fixture(scope="module")
def tp2_sp_changed_comfy(request, tmp_path_factory, models):
    """Sequence parallel asked for, on a ComfyUI whose DiTBlock.forward changed (tests/comfy/fixtures/h3_changed_block)."""
    root = str(tmp_path_factory.mktemp("sp_changed"))
    for r in range(2):
        os.makedirs(os.path.join(root, f"rank{r}", "custom_nodes"))
        os.symlink(os.path.join(FIXTURES, "h3_changed_block"), os.path.join(root, f"rank{r}", "custom_nodes", "h3_changed_block"))
    return stop_at_teardown(request, start_ranks(root, 2, models, TP_ENV | {"TP2_SEQUENCE_PARALLEL": "1"}), root)


def test_changed_comfyui_code_falls_back_to_plain_tp_with_a_log_line(tp2, tp2_sp_changed_comfy):
    wf = tiny_workflow(INT8, COND, prefix="sp_changed")
    sp = ok(tp2_sp_changed_comfy, run_prompt(tp2_sp_changed_comfy, wf))
    plain = ok(tp2, run_prompt(tp2, wf))
    assert sp[0] == sp[1]
    for kind in ("video", "audio"):
        assert latent(sp[0], kind).equal(latent(plain[0], kind)), kind
    with open(tp2_sp_changed_comfy[0].log_path, "rb") as f:
        log = f.read().decode(errors="replace")
    assert "sequence parallelism off for this model: ComfyUI's H3 code it stands in for changed (DiTBlock.forward (" in log
    assert "sequence parallel:" not in log  # the sequence-parallel forward never ran


@pytest.fixture(scope="module")
def tp1_pack(request, tmp_path_factory, models):
    """tp_size 1 as a first-class size: the pack active on one server (TP2_WORLD_SIZE=1) with its own block path
    (sequence parallelism's forward, int8 rows; its gathers and reduce-scatters are no-ops), no peer to talk to."""
    env = TP_ENV | {"TP2_SEQUENCE_PARALLEL": "1"}
    return servers_for(request, tmp_path_factory, models, "tp1_pack", 1, env)


@pytest.mark.parametrize("unet", [INT8, FULL])
def test_tp_size_1_with_the_pack_equals_tp2(request, tp1_pack, tp2, unet):
    wf = tiny_workflow(unet, COND, prefix=f"tp1_{unet[:-12]}")
    one = ok(tp1_pack, run_prompt(tp1_pack, wf))[0]
    two = ok(tp2, run_prompt(tp2, wf))[0]
    for kind in ("video", "audio"):
        a, b = latent(one, kind), latent(two, kind)
        print(f"tp1 with the pack, {unet} {kind}: max relative difference to TP2 {rel(a, b):.1e}, SQNR {sqnr_db(b, a):.1f} dB")
        assert (rel(a, b) < 1e-4) if unet == FULL else (sqnr_db(b, a) >= 25.0), (kind, rel(a, b), sqnr_db(b, a))
    line = _sequence_parallel_line(tp1_pack[0])
    assert "this rank holds" in line, line  # the pack's block path ran, on one rank
    with open(tp1_pack[0].log_path, "rb") as f:
        assert f"loaded {unet} (mapped whole)" in f.read().decode(errors="replace")  # tp 1: nothing to cut
