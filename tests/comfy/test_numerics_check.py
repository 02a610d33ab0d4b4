"""The numerics check on real ComfyUI servers: an int8 H3 model loads only where this rank's int8 path measures
right against exact math. Rank 1's int8 GEMM is made wrong on purpose (TP2_TEST_BREAK_INT8_RANKS=1, rows rolled as
swapped tiles would be): the int8 prompt is refused on every rank within seconds, rank 1 with the GPU, kernel and
dB, rank 0 naming rank 1; a float model (no int8 path) still runs; the status node shows each rank's report."""

from __future__ import annotations

import re
import time

import pytest
from comfy_harness import COMFYUI_DIR, assert_success, error_message, have_comfyui, run_prompt, servers_for, tiny_workflow
from conftest import make_checkpoint, make_tiny_h3

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

COND, INT8, FLOAT = "h3_tiny_cond.safetensors", "h3_tiny_int8.safetensors", "h3_tiny_float.safetensors"


@pytest.fixture(scope="module")
def broken_rank1(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("numerics_models")
    make_checkpoint(str(d / INT8), "--int8")
    make_checkpoint(str(d / FLOAT))
    make_tiny_h3.main(["--conditioning", str(d / COND)])
    models = {
        f"diffusion_models/{INT8}": str(d / INT8),
        f"diffusion_models/{FLOAT}": str(d / FLOAT),
        f"h3_conditioning/{COND}": str(d / COND),
    }
    env = {"TP2_TEST_BREAK_INT8_RANKS": "1", "TP2_PROMPT_TIMEOUT_S": "20", "TP2_TIMEOUT_S": "30"}
    return servers_for(request, tmp_path_factory, models, "numerics_world", tp_size=2, env=env)


def test_a_wrong_int8_path_is_refused_on_every_rank_and_float_still_runs(broken_rank1):
    servers = broken_rank1
    t0 = time.monotonic()
    hs = run_prompt(servers, tiny_workflow(INT8, COND, prefix="numerics_int8"), 60)
    assert time.monotonic() - t0 < 60
    assert all(h["status"]["status_str"] == "error" for h in hs), [h["status"] for h in hs]
    msg1 = error_message(hs[1])
    assert "the int8 path on cpu" in msg1 and "gives wrong numbers: int8 GEMM measured" in msg1, msg1
    assert "(broken on purpose by TP2_TEST_BREAK_INT8_RANKS)" in msg1 and "TP2_INT8_KERNEL=triton" in msg1, msg1
    assert msg1.startswith("minimax_h3_tp2.NumericsError: ") and "custom_nodes" not in msg1, msg1  # no file paths
    db = float(re.search(r"int8 GEMM measured (-?[\d.]+) dB", msg1).group(1))
    assert db < 25, msg1
    msg0 = error_message(hs[0])
    assert "rank 1" in msg0 and "wrong numbers" in msg0, msg0
    assert_success(servers, run_prompt(servers, tiny_workflow(FLOAT, COND, prefix="numerics_float")))


def test_the_status_node_shows_each_ranks_numerics_report(broken_rank1):
    servers = broken_rank1
    hs = run_prompt(servers, {"1": {"class_type": "TP2Status", "inputs": {}}})
    assert_success(servers, hs)
    text0, text1 = (h["outputs"]["1"]["text"][0] for h in hs)
    healthy = re.search(r"numerics check: passed on cpu .*int8 GEMM (\d+\.\d) dB", text0)
    assert healthy and float(healthy.group(1)) >= 25, text0
    assert "numerics check: FAILED on cpu" in text1, text1
    assert "patched: comfy.sd.load_diffusion_model, " in text0 and "execution.PromptExecutor.execute_async" in text0, text0
    # the float model the first test ran: where its weights came from, and what the pack changed on it, by kind
    for text in (text0, text1):
        assert f"model {FLOAT}: " in text and "; shard-on-read, " in text, text
        changed = re.search(r"changed on the model: forward of (\d+) Linear, (?:forward of \d+ (?:MLP|DiTBlock), )?preprocess_text_embeds of 1 MiniMaxH3Model", text)
        assert changed and int(changed.group(1)) >= 4, text  # out_proj and fc2 of each block at least


@pytest.fixture(scope="module")
def short_of_memory(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("capacity_models")
    make_checkpoint(str(d / FLOAT))
    make_tiny_h3.main(["--conditioning", str(d / COND)])
    models = {f"diffusion_models/{FLOAT}": str(d / FLOAT), f"h3_conditioning/{COND}": str(d / COND)}
    env = {"TP2_TEST_AVAILABLE_GIB": "0.5", "TP2_PROMPT_TIMEOUT_S": "20", "TP2_TIMEOUT_S": "30"}
    return servers_for(request, tmp_path_factory, models, "capacity_world", tp_size=2, env=env)


def test_a_prompt_predicted_not_to_fit_is_advised_not_refused(short_of_memory):
    """The capacity advice (nodes/capacity_check.py) with 0.5 GiB taken as available (TP2_TEST_AVAILABLE_GIB): the
    prediction for the tiny model is its fixed buffers (~2 GiB), so every rank logs at its sampler that it may not
    fit, with the numbers and what would, and the prompt still runs (only a real out-of-memory stops it)."""
    hs = run_prompt(short_of_memory, tiny_workflow(FLOAT, COND, prefix="capacity"), 60)
    assert_success(short_of_memory, hs)
    for s in short_of_memory:
        text = open(s.log_path).read()
        assert "capacity: 64x64x5" in text and "may not fit: 64x64x5 was predicted to need ~" in text, s.tail()
        # the CPU computes in fp32 (tp2/compute_dtype.py): the prediction and the advice are fp32's
        assert "64x64x5, 280 rows, fp32 compute: predicted peak" in text, s.tail()
        assert (
            "at tp_size 2 with the weights resident in fp32 compute, 0.5 GiB more was available: not even 5 frames fit at 64x64" in text
        ), s.tail()
