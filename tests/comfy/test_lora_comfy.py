"""LoRAs under TP on real ComfyUI servers (CPU, gloo), loaded with the stock LoraLoaderModelOnly node.

The LoRAs come from scripts/make_tiny_lora.py for the checkpoint they patch and cover qkv_proj, out_proj, fc1,
fc2 and adaln_proj.linear of every block and of the token refiner (column-parallel packed, row-parallel, and the
adaln either replicated (curve form) or row-parallel with split input (full form)). Their update is about half
of each weight, so a rank applying a wrong slice (or a full-width one) moves the latent by far more than the
thresholds of test_tp_comfy.py, which are reused: float 1e-4 relative, int8 ConvRot SQNR >= 25 dB.
"""

from __future__ import annotations

import os

import pytest
from comfy_harness import COMFYUI_DIR, error_message, have_comfyui, new_id, run_prompt, servers_for, submit_once, tiny_workflow
from conftest import TINY_COND, make_models, make_tiny_h3
from test_tp_comfy import TP_ENV, latent, ok, rel, sqnr_db

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

COND = TINY_COND
INT8, FULL = "h3_tiny_int8.safetensors", "h3_tiny_full_adaln.safetensors"
LORA = {INT8: "lora_int8.safetensors", FULL: "lora_full.safetensors"}
DORA, OTHER = "lora_dora.safetensors", "lora_other.safetensors"


def _make_lora(ckpt: str, out: str, *args: str) -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_tiny_lora", os.path.join(os.path.dirname(make_tiny_h3.__file__), "make_tiny_lora.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([ckpt, out, "--refiner", *args]) == 0
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_models")
    out = make_models(str(d), {INT8: ("--int8",), FULL: ("--adaln", "full")})
    for ckpt, name in LORA.items():
        out[f"loras/{name}"] = _make_lora(str(d / ckpt), str(d / name), *(["--format", "kohya"] if ckpt == FULL else []))
    out[f"loras/{DORA}"] = _make_lora(str(d / INT8), str(d / DORA), "--dora", "blocks.1.attn.qkv_proj")
    out[f"loras/{OTHER}"] = str(d / OTHER)  # rank 1's file of this name differs: see test_lora_mismatch
    _make_lora(str(d / INT8), str(d / OTHER))
    _make_lora(str(d / INT8), str(d / "lora_other_seed1.safetensors"), "--seed", "1")
    return out


@pytest.fixture(scope="module")
def tp2(request, tmp_path_factory, models):
    return servers_for(request, tmp_path_factory, models, "lora_tp2", 2, TP_ENV)


@pytest.fixture(scope="module")
def plain(request, tmp_path_factory, models):
    return servers_for(request, tmp_path_factory, models, "lora_plain")[0]


def lora_workflow(unet: str, lora: str | None, strength: float, prefix: str) -> dict:
    wf = tiny_workflow(unet, COND, prefix=prefix)
    if lora is not None:
        wf["9"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": lora, "strength_model": strength}}
        wf["5"]["inputs"]["model"] = ["9", 0]
    return wf


@pytest.mark.parametrize("unet", [INT8, FULL])
def test_lora_tp2_matches_one_server(tp2, plain, unet):
    tag = unet[:-12]
    base = latent(ok([plain], run_prompt([plain], lora_workflow(unet, None, 0, f"nolora_{tag}")))[0], "video")
    for strength in (1.0, 0.5):
        wf = lora_workflow(unet, LORA[unet], strength, f"lora_{tag}_{strength}")
        tp_files = ok(tp2, run_prompt(tp2, wf))
        assert tp_files[0] == tp_files[1], "ranks wrote different bytes"
        ref = ok([plain], run_prompt([plain], wf))[0]
        for kind in ("video", "audio"):
            a, b = latent(tp_files[0], kind), latent(ref, kind)
            print(f"{unet} strength {strength} {kind}: rel {rel(a, b):.2e}, SQNR {sqnr_db(b, a):.1f} dB")
            if unet == INT8:
                assert sqnr_db(b, a) >= 25.0, (kind, sqnr_db(b, a))
            else:
                assert rel(a, b) < 1e-4, (kind, rel(a, b))
        moved = rel(latent(ref, "video"), base)
        print(f"{unet} strength {strength}: the LoRA moved the video latent by {moved:.2f} (relative)")
        assert moved > 0.05, "the LoRA had no visible effect: the test would not catch a wrong slice"


def test_lora_mismatch_between_ranks_refused_on_both(tp2, models):
    link = os.path.join(tp2[1].base, "models", "loras", OTHER)
    os.remove(link)
    os.symlink(os.path.join(os.path.dirname(models[f"loras/{OTHER}"]), "lora_other_seed1.safetensors"), link)
    hs = run_prompt(tp2, lora_workflow(INT8, OTHER, 1.0, "mismatch"), timeout_s=60)
    for h in hs:
        msg = error_message(h)
        assert h["status"]["status_str"] == "error" and "RankMismatchError" in msg, msg
        assert "'patches' (rank 0:" in msg, msg
    ok(tp2, run_prompt(tp2, lora_workflow(INT8, LORA[INT8], 1.0, "after_mismatch")))


def test_dora_on_sharded_layer_refused_with_its_key(tp2):
    hs = run_prompt(tp2, lora_workflow(INT8, DORA, 1.0, "dora"), timeout_s=60)
    for h in hs:
        msg = error_message(h)
        assert h["status"]["status_str"] == "error" and "AdapterPlacementError" in msg, msg
        assert "diffusion_model.blocks.1.attn.qkv_proj.weight: DoRA" in msg, msg
    pid = new_id()
    submit_once(tp2, lora_workflow(INT8, None, 0, "after_dora"), pid)
    assert all(s.wait_history(pid, 60)["status"]["status_str"] == "success" for s in tp2)
