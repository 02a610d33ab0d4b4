"""ComfyUI's own speed-ups, samplers and guidance under TP, through the product path (issue 50): scripts/start-tp2.sh
starts two CPU ranks (default settings, then --fast), scripts/tp2-submit queues each workflow once on rank 0's front
door and exits 0 only when every rank succeeded and every output file is byte-identical on every rank. The tiny demo
workflow (tiny int8 H3, conditioning from a file, the small random VAE: a 5-frame WEBP and both latents) carries:

- EasyCache and LazyCache at the issue's settings (reuse_threshold 3.0, start 0.1, 20 steps). Before the fix rank 0's
  EasyCache added its cached diff to rank 0's own model input, which ComfyUI's denoise reads, and rank 1's to a copy:
  the decode refused the ranks' different latents;
- CFG above 1 with a real negative (a second conditioning file), which changes the video against a zeroed one;
- the official H3 templates' sampling (SamplerCustomAdvanced, BasicGuider, KSamplerSelect res_multistep,
  BasicScheduler simple, RandomNoise) under ModelSamplingMiniMaxH3's shift; CFGGuider with CFGZeroStar,
  dpmpp_2m_sde, the normal schedule and SkipLayerGuidanceDiT on the first block; APG, SkipLayerGuidanceDiT on the
  last block (under --fast the first block splits the rows over the ranks, the last gathers them: a skipped one did
  neither, and the sampler failed) and ModelAttentionBackend with euler and sgm_uniform; KSampler with
  euler_ancestral and the beta schedule;
- TorchCompileModel (inductor).

Then ComfyUI's --use-sage-attention, with a stand-in kernel on the CPU (fixtures/sage_standin): every rank runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from comfy_harness import COMFYUI_DIR, ROOT, demo_workflow, have_comfyui, launch, stop_launched, tiny_base

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

NEG = "h3_tiny_negative.safetensors"
MODES = {"default": (), "fast": ("--fast",)}
ENV = {"TP2_PROMPT_TIMEOUT_S": "60", "TP2_TIMEOUT_S": "120"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from conftest import make_tiny_h3

    root = tmp_path_factory.mktemp("speedups")
    base = tiny_base(root)
    make_tiny_h3.main(["--conditioning", os.path.join(base, "models", "h3_conditioning", NEG), "--seed", "1"])
    return root, base


@pytest.fixture(scope="module", params=list(MODES))
def ranks(request, base):
    root, base_dir = base
    launched = launch(root / request.param, base_dir, ENV, args=MODES[request.param])
    yield dict(launched, mode=request.param)
    stop = stop_launched(launched)
    assert stop.returncode == 0, stop.stderr


def run_submit(ranks, wf: dict, tmp_path, name: str, timeout: int = 240) -> subprocess.CompletedProcess:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(wf))
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "tp2-submit"), str(path), "--ports", ",".join(map(str, ranks["ports"])),
           "--out", str(tmp_path / name), "--quiet", "--timeout", str(timeout)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60)


def submit(ranks, wf: dict, tmp_path, name: str, timeout: int = 240) -> dict[str, str]:
    """Queue `wf` through tp2-submit; {file name on rank 0: sha256} of the outputs, once it says every rank's match."""
    res = run_submit(ranks, wf, tmp_path, name, timeout)
    assert res.returncode == 0, f"{name}: {res.stdout}{res.stderr}"
    rows = [line.split() for line in res.stdout.splitlines() if line.strip().startswith("rank ")]
    files = {os.path.basename(r[3]): r[2] for r in rows if r[1] == "0:"}
    assert len(files) == 3 and len(rows) == 6, res.stdout  # the WEBP and two latents, on both ranks
    return files


def rank_log(ranks, rank: int) -> str:
    with open(os.path.join(ranks["run_dir"], f"rank{rank}.log"), errors="replace") as f:
        return f.read()


def last_line(ranks, rank: int, text: str) -> str:
    return [line for line in rank_log(ranks, rank).splitlines() if text in line][-1].strip()


def tiny(name: str, steps: int = 6) -> dict:
    wf = demo_workflow(name, steps=steps)
    wf["30"] = {"class_type": "LoadH3Conditioning", "inputs": {"file": NEG}}
    return wf


def custom_sampling(wf: dict, model: list, guider: dict, scheduler: str, sampler: str) -> dict:
    """The official H3 templates' sampling in place of the KSampler: SamplerCustomAdvanced with `guider`."""
    del wf["5"]
    wf.update({
        "31": {"class_type": "RandomNoise", "inputs": {"noise_seed": 7}},
        "32": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler}},
        "33": {"class_type": "BasicScheduler", "inputs": {"model": model, "scheduler": scheduler, "steps": 6, "denoise": 1.0}},
        "34": guider,
        "35": {"class_type": "SamplerCustomAdvanced",
               "inputs": {"noise": ["31", 0], "guider": ["34", 0], "sampler": ["32", 0], "sigmas": ["33", 0], "latent_image": ["4", 0]}},
    })  # fmt: skip
    wf["6"]["inputs"]["av_latent"] = ["35", 0]
    return wf


@pytest.mark.parametrize("node", ["EasyCache", "LazyCache"])
def test_cache_nodes_skip_the_same_steps_on_every_rank(ranks, tmp_path, node):
    """The issue's run: each rank's cache skips steps (the same number on both) and the files match."""
    wf = tiny(node.lower(), steps=20)
    wf["20"] = {
        "class_type": node,
        "inputs": {"model": ["1", 0], "reuse_threshold": 3.0, "start_percent": 0.1, "end_percent": 0.95, "verbose": False},
    }
    wf["5"]["inputs"]["model"] = ["20", 0]
    submit(ranks, wf, tmp_path, node)
    skipped = [last_line(ranks, r, f"{node} - skipped ").split(" - ")[-1] for r in (0, 1)]
    assert skipped[0] == skipped[1] and not skipped[0].startswith("skipped 0/") and "/20 steps" in skipped[0], skipped


def test_cfg_above_1_with_a_real_negative(ranks, tmp_path):
    """KSampler at CFG 3 with euler_ancestral (its noise from the seed) and the beta schedule: the negative
    conditioning file, against the zeroed negative, changes every output, and the ranks agree on both."""
    wf = tiny("cfg_negative")
    wf["5"]["inputs"].update(cfg=3.0, negative=["30", 0], sampler_name="euler_ancestral", scheduler="beta")
    real = submit(ranks, wf, tmp_path, "negative")
    wf = tiny("cfg_zeroed")
    wf["5"]["inputs"].update(cfg=3.0, sampler_name="euler_ancestral", scheduler="beta")
    zeroed = submit(ranks, wf, tmp_path, "zeroed")
    assert not set(real.values()) & set(zeroed.values()), (real, zeroed)


def _template(wf):
    wf["40"] = {"class_type": "MiniMaxH3SigmaShift", "inputs": {"model": ["1", 0], "shift_video": 12.0, "shift_audio": 3.0}}
    guider = {"class_type": "BasicGuider", "inputs": {"model": ["40", 0], "conditioning": ["2", 0]}}
    return custom_sampling(wf, ["40", 0], guider, "simple", "res_multistep")


def _cfg_guider(wf):
    wf["40"] = {"class_type": "MiniMaxH3SigmaShift", "inputs": {"model": ["1", 0], "shift_video": 5.0, "shift_audio": 2.0}}
    wf["41"] = {"class_type": "CFGZeroStar", "inputs": {"model": ["40", 0]}}
    wf["42"] = _skip_layer(["41", 0], "0")  # the first block: under --fast the next one takes this rank's rows
    guider = {"class_type": "CFGGuider", "inputs": {"model": ["42", 0], "positive": ["2", 0], "negative": ["30", 0], "cfg": 4.0}}
    return custom_sampling(wf, ["42", 0], guider, "normal", "dpmpp_2m_sde")


def _skip_layer(model: list, layers: str) -> dict:
    inputs = {"model": model, "double_layers": layers, "single_layers": "", "scale": 3.0, "start_percent": 0.01, "end_percent": 0.8}
    return {"class_type": "SkipLayerGuidanceDiT", "inputs": dict(inputs, rescaling_scale=0.0)}


def _guidance_patches(wf):
    wf["40"] = {"class_type": "APG", "inputs": {"model": ["1", 0], "eta": 1.0, "norm_threshold": 5.0, "momentum": -0.5}}
    wf["41"] = _skip_layer(["40", 0], "1")  # the last block, which gathers the rows under --fast: its stand-in does
    wf["42"] = {"class_type": "ModelAttentionBackend", "inputs": {"model": ["41", 0], "attention": "pytorch attention"}}
    wf["5"]["inputs"].update(model=["42", 0], cfg=2.0, negative=["30", 0], sampler_name="euler", scheduler="sgm_uniform")
    return wf


@pytest.mark.parametrize("edit", [_template, _cfg_guider, _guidance_patches], ids=["template", "cfg_guider", "guidance_patches"])
def test_template_sampling_and_guidance_nodes(ranks, tmp_path, edit):
    submit(ranks, edit(tiny(edit.__name__.strip("_"))), tmp_path, edit.__name__.strip("_"))


def test_torch_compile_model(ranks, tmp_path):
    """ComfyUI's TorchCompileModel (inductor, a C++ compiler on the CPU): by default the forward around the pack's
    wrapper is compiled, the pack's sharing of rank 0's inputs stays eager. Under --fast on the CPU, inductor fails
    generating C++ for the sequence-parallel blocks (torch 2.14: KeyError 'buf1'), so every rank refuses the prompt
    before the sampler starts, naming the node and why."""
    wf = tiny("compiled", steps=3)
    wf["20"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["1", 0], "backend": "inductor"}}
    wf["5"]["inputs"]["model"] = ["20", 0]
    if ranks["mode"] == "default":
        submit(ranks, wf, tmp_path, "compiled", timeout=480)
        return
    res = run_submit(ranks, wf, tmp_path, "compiled")
    refusal = "TorchCompileModel cannot run with sequence parallelism on the CPU"
    assert res.returncode == 1 and refusal in res.stderr, res.stdout + res.stderr
    for r in (0, 1):  # the sampler's progress bar (3 steps: no other prompt here has 3) never started
        log = rank_log(ranks, r)
        assert refusal in log and "InductorError" not in log and "/3 [" not in log, log[-3000:]


def test_sage_attention_flag_runs_on_every_rank(base, tmp_path):
    """ComfyUI started with --use-sage-attention (the stand-in kernel: the real one needs an NVIDIA GPU): the pack
    uses ComfyUI's choice on every rank (it overrode it with its own before), its numerics check included."""
    root, base_dir = base
    calls = tmp_path / "sage_calls"
    env = dict(ENV, PYTHONPATH=os.path.join(ROOT, "tests", "comfy", "fixtures", "sage_standin"), TP2_TEST_SAGE_CALLS=str(calls))
    launched = launch(root / "sage", base_dir, env, comfy_args=("--use-sage-attention",))
    try:
        submit(launched, tiny("sage"), tmp_path, "sage")
        for r in (0, 1):
            assert "attention ComfyUI's (--use-sage-attention)" in last_line(launched, r, "numerics check of the int8 path: passed")
            with open(f"{calls}.rank{r}") as f:
                assert len(f.readlines()) > 6, f"rank {r}: the sampler's attention did not run ComfyUI's sage"
    finally:
        assert stop_launched(launched).returncode == 0
