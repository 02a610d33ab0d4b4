"""H3's text encoder under tensor parallelism on real ComfyUI servers (CPU, gloo): CLIPLoader (type minimax) ->
CLIPTextEncode -> SaveH3Conditioning on TP ranks and on one plain server; the ranks' conditioning files are
byte-identical, and equal to the plain server's within the tolerance below.

The encoder is NOT the real one (25.8 B parameters): scripts/make_tiny_qwen3vl.py writes random weights with the
real key names at tiny widths (16 query heads, 8 KV heads, 50 layers), and a test-only custom node
(tests/comfy/fixtures/h3_tiny_text_encoder, linked into these servers only) makes ComfyUI build its own classes
at those widths. The pack's per-rank width override and the shard-on-read path are the ones the real file takes.

Tolerance: the ranks sum o_proj's and down_proj's partial products where one device sums the whole product in
one GEMM; on CPU ComfyUI runs the encoder in fp32 (every quantised format is dequantised first: the H3 encoder's
linears are full-precision matmuls), so the 50 layers differ by fp32 re-association only (measured ~1e-6
relative). The bound, 1e-4, is two orders above that and four below what a missing all-reduce, a wrong slice or
a swapped KV head gives (order 1; a different prompt is checked to land far outside it).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from comfy_harness import (
    COMFYUI_DIR,
    ROOT,
    Server,
    assert_success,
    error_message,
    have_comfyui,
    new_id,
    output_files,
    run_prompt,
    start_ranks,
    stop_at_teardown,
    submit_once,
)
from safetensors.torch import load

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

FIXTURE_DIR = os.path.join(ROOT, "tests", "comfy", "fixtures")
TINY_TE = {"H3_TEST_TINY_TE": "1"}
TP_ENV = {"TP2_PROMPT_TIMEOUT_S": "20", "TP2_TIMEOUT_S": "30", **TINY_TE}
FORMATS = ("bf16", "int8", "fp8", "nvfp4")
PROMPT = "A red fox trots through fresh snow in a quiet birch forest at dawn."
REL_TOL = 1e-4
BIG_FFN = "h3_tiny_te_ffn4096.safetensors"


def te_file(fmt: str) -> str:
    return f"h3_tiny_te_{fmt}.safetensors"


def _base(root: str, name: str) -> str:
    base = os.path.join(root, name)
    os.makedirs(os.path.join(base, "custom_nodes"))
    os.symlink(os.path.join(FIXTURE_DIR, "h3_tiny_text_encoder"), os.path.join(base, "custom_nodes", "h3_tiny_text_encoder"))
    return base


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("te_models"))
    out = {}
    for fmt in FORMATS:
        path = os.path.join(root, te_file(fmt))
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "scripts", "make_tiny_qwen3vl.py"), path, "--format", fmt], check=True, timeout=300
        )
        out[f"text_encoders/{te_file(fmt)}"] = path
    path = os.path.join(root, BIG_FFN)  # decoder-heavy (the tiny file is mostly its replicated 151936-token embedding)
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_qwen3vl.py"), path, "--ffn", "4096"], check=True, timeout=300)
    out[f"text_encoders/{BIG_FFN}"] = path
    return out


def start_servers(request, tmp_path_factory, models, tp_size: int, env=TP_ENV) -> tuple[Server, list[Server]]:
    root = str(tmp_path_factory.mktemp(f"te_tp{tp_size}"))
    for name in ("plain", *(f"rank{r}" for r in range(tp_size))):
        _base(root, name)
    plain = Server(os.path.join(root, "plain"), models, TINY_TE)  # starts now, alongside the ranks
    ranks = start_ranks(root, tp_size, models, env)
    plain.wait_ready()
    stop_at_teardown(request, [*ranks, plain], root)
    return plain, ranks


@pytest.fixture(scope="module")
def tp2(request, tmp_path_factory, models):
    return start_servers(request, tmp_path_factory, models, 2)


def encode_workflow(clip: str, prefix: str, text: str = PROMPT) -> dict:
    return {
        "1": {"class_type": "CLIPLoader", "inputs": {"clip_name": clip, "type": "minimax", "device": "default"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": text}},
        "3": {"class_type": "SaveH3Conditioning", "inputs": {"conditioning": ["2", 0], "filename_prefix": prefix}},
    }


def encode_everywhere(servers: list[Server], workflow: dict) -> list[dict]:
    histories = run_prompt(servers, workflow, 300)
    assert_success(servers, histories)
    return [load(next(iter(output_files(s, h).values()))) for s, h in zip(servers, histories)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fmt", FORMATS)
def test_tp2_conditioning_matches_one_device(tp2, fmt):
    plain, ranks = tp2
    ref, *got = encode_everywhere([plain, *ranks], encode_workflow(te_file(fmt), f"te_{fmt}"))
    for r, cond in enumerate(got):
        assert cond.keys() == ref.keys(), f"rank {r}: {sorted(cond)} vs plain {sorted(ref)}"
        assert torch.equal(cond["cond"], got[0]["cond"]), f"rank {r}'s conditioning differs from rank 0's"
        assert torch.equal(cond["token_tags"], ref["token_tags"])
    err = rel_err(got[0]["cond"], ref["cond"])
    assert err < REL_TOL, f"{fmt}: TP2 conditioning is {err:.2e} away from one device's (tolerance {REL_TOL})"
    print(f"{fmt}: TP2 vs one device relative error {err:.2e}, shape {tuple(ref['cond'].shape)}")
    # the tolerance is meaningful: another prompt's conditioning is far outside it
    other = encode_everywhere([plain], encode_workflow(te_file(fmt), f"te_{fmt}_other", PROMPT + " At night."))[0]
    if other["cond"].shape == ref["cond"].shape:
        assert rel_err(other["cond"], ref["cond"]) > 50 * REL_TOL


@pytest.fixture(scope="module")
def tp2_uneven(request, tmp_path_factory, models):
    """Two ranks at shares 5:3 (TP2_SPLIT, as the launcher's --split sets it)."""
    return start_servers(request, tmp_path_factory, models, 2, dict(TP_ENV, TP2_SPLIT="5:3"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_uneven_shares_conditioning_matches_one_device(tp2_uneven, fmt):
    """KV heads 5 + 3 (each with its query heads), FFN columns in whole 16-column blocks, the vocabulary 5:3."""
    plain, ranks = tp2_uneven
    ref, *got = encode_everywhere([plain, *ranks], encode_workflow(te_file(fmt), f"te53_{fmt}"))
    assert all(torch.equal(cond["cond"], got[0]["cond"]) for cond in got[1:]), "the ranks' conditionings differ"
    err = rel_err(got[0]["cond"], ref["cond"])
    print(f"{fmt}: TP2 at 5:3 vs one device relative error {err:.2e}")
    assert err < REL_TOL, f"{fmt}: TP2 at 5:3 conditioning is {err:.2e} away from one device's (tolerance {REL_TOL})"
    for s in ranks:  # each rank built its own widths (the tiny encoder: 8 KV heads, FFN 256)
        assert "KV heads 8->5+3, ffn 256->160+96" in open(s.log_path).read()


def test_tp2_logs_say_sliced(tp2):
    plain, ranks = tp2
    encode_everywhere([plain, *ranks], encode_workflow(te_file("bf16"), "te_log"))
    for s in ranks:
        with open(s.log_path, errors="replace") as f:
            text = f.read()
        assert "loaded text encoder h3_tiny_te_bf16.safetensors (shard-on-read)" in text, s.tail()
        assert "heads 16->8/rank, KV heads 8->4/rank, ffn 256->128/rank" in text
        assert "text encode over 2 ranks" in text


def test_tp2_refuses_a_qwen_model_that_is_not_h3s(tp2, tmp_path):
    """A Qwen language model with type 'minimax' that ComfyUI would not build as H3's encoder: refused before loading."""
    plain, ranks = tp2
    from safetensors.torch import save_file

    bogus = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8), "model.layers.0.input_layernorm.weight": torch.ones(8)}
    for s in ranks:
        save_file(bogus, os.path.join(s.base, "models", "text_encoders", "qwen_not_h3.safetensors"))
    pid = new_id()
    submit_once(ranks, encode_workflow("qwen_not_h3.safetensors", "te_bogus"), pid)
    for s in ranks:
        h = s.wait_history(pid, 120)
        assert h["status"]["status_str"] == "error"
        assert "is not MiniMax-H3's text encoder" in error_message(h), error_message(h)
    # the servers are usable after
    encode_everywhere(ranks, encode_workflow(te_file("bf16"), "te_after_refusal"))


def _status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.fixture(scope="module")
def tp4(request, tmp_path_factory, models):
    return start_servers(request, tmp_path_factory, models, 4)


def test_follower_never_holds_the_whole_encoder(request, tmp_path_factory, models):
    """Each rank's peak resident memory grows by less than the file while it loads and runs the encoder (it reads
    its slices only): 4 ranks, a file whose decoder is most of it (FFN 4096), weights kept in the file's bf16
    (--bf16-text-enc: ComfyUI's CPU default would store them in fp32, twice the file), the peak reset after a
    first encoder load (which imports transformers and builds the tokenizer, some 150 MiB whatever the file).
    On a CPU-only ComfyUI the state dict is copied into the built model (its patcher is not dynamic), so the peak
    is about three times this rank's share (measured: 153 MiB for a 53 MiB share of a 207 MiB file); with dynamic
    VRAM (CUDA) ComfyUI assigns the tensors instead of copying them (1x H200: 9.9 GiB for a 15.3 GiB file)."""
    root = str(tmp_path_factory.mktemp("te_rss"))
    for r in range(4):
        _base(root, f"rank{r}")
    ranks = stop_at_teardown(request, start_ranks(root, 4, models, TP_ENV, args=("--bf16-text-enc",)), root)
    size_kb = os.path.getsize(models[f"text_encoders/{BIG_FFN}"]) // 1024
    warm = encode_workflow(te_file("bf16"), "te_warm")  # the first encoder load imports transformers and builds the tokenizer
    warm["3"] = {"class_type": "TP2Status", "inputs": {"after": ["2", 0]}}
    pid = new_id()
    submit_once(ranks, warm, pid)
    assert_success(ranks, [s.wait_history(pid, 300) for s in ranks])
    before = []
    for s in ranks:
        with open(f"/proc/{s.proc.pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before.append(_status_kb(s.proc.pid, "VmRSS"))
    wf = encode_workflow(BIG_FFN, "te_rss")
    wf["3"] = {"class_type": "TP2Status", "inputs": {"after": ["2", 0]}}  # load and encode only
    pid = new_id()
    submit_once(ranks, wf, pid)
    assert_success(ranks, [s.wait_history(pid, 300) for s in ranks])
    from tp2.checkpoint import CheckpointLayout
    from tp2.te_plan import resolve_te_plan

    plan = resolve_te_plan(CheckpointLayout.from_file(models[f"text_encoders/{BIG_FFN}"]), 4)
    share_kb = sum(math.prod(t.local_shape(0)) * 2 for t in plan.tensors.values()) // 1024  # bf16
    for r, s in enumerate(ranks):
        grew = _status_kb(s.proc.pid, "VmHWM") - before[r]
        print(
            f"rank {r}/4: peak RSS grew by {grew / 1024:.1f} MiB loading a {size_kb / 1024:.1f} MiB encoder (share {share_kb / 1024:.1f} MiB)"
        )
        assert 0 < grew < size_kb, f"rank {r}'s peak RSS grew by {grew} KiB with a {size_kb} KiB file: it held the whole encoder"


@pytest.mark.parametrize("fmt", ["nvfp4", "int8"])
def test_tp4_conditioning_matches_one_device(tp4, fmt):
    plain, ranks = tp4
    ref, *got = encode_everywhere([plain, *ranks], encode_workflow(te_file(fmt), f"te4_{fmt}"))
    for r, cond in enumerate(got):
        assert torch.equal(cond["cond"], got[0]["cond"]), f"rank {r}'s conditioning differs from rank 0's"
    err = rel_err(got[0]["cond"], ref["cond"])
    assert err < REL_TOL, f"{fmt}: TP4 conditioning is {err:.2e} away from one device's (tolerance {REL_TOL})"
    print(f"{fmt}: TP4 vs one device relative error {err:.2e}")
