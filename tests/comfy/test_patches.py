"""The pack's registry of ComfyUI patches (nodes/patches.py) against a real ComfyUI checkout, in a fresh process:
every install function puts its patch in the registry once and the registry lists them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from comfy_harness import COMFYUI_DIR, ROOT, have_comfyui

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

EXPECTED = [
    "comfy.sd.load_diffusion_model",
    "comfy.model_management.unet_manual_cast",
    "comfy.sd.load_clip",
    "comfy.sd.load_lora_for_models",
    "comfy.sd.load_bypass_lora_for_models",
    "comfy.ops.linear_input_act",
    "comfy.utils.ProgressBar.update_absolute",
    "comfy.ops.run_every_op",
    "execution.PromptExecutor.execute_async",
    "comfy.ldm.minimax.vae.MiniMaxH3VideoVAE.decode_temporal",
    "comfy.sd.VAE.decode",
    "comfy.sd.VAE.decode_tiled",
    "execution.get_output_from_returns",
]

SCRIPT = r"""
import importlib, json, sys, types
sys.path.insert(0, COMFYUI)
sys.argv = ["main.py", "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import comfy.sd, comfy.ops, comfy.utils, comfy.model_management, execution
import comfy.ldm.minimax.vae as vae
targets = {"comfy.sd.load_diffusion_model": (comfy.sd, "load_diffusion_model"),
           "comfy.model_management.unet_manual_cast": (comfy.model_management, "unet_manual_cast"),
           "comfy.sd.load_clip": (comfy.sd, "load_clip"),
           "comfy.sd.load_lora_for_models": (comfy.sd, "load_lora_for_models"),
           "comfy.sd.load_bypass_lora_for_models": (comfy.sd, "load_bypass_lora_for_models"),
           "comfy.ops.linear_input_act": (comfy.ops, "linear_input_act"),
           "comfy.utils.ProgressBar.update_absolute": (comfy.utils.ProgressBar, "update_absolute"),
           "comfy.ops.run_every_op": (comfy.ops, "run_every_op"),
           "execution.PromptExecutor.execute_async": (execution.PromptExecutor, "execute_async"),
           "comfy.ldm.minimax.vae.MiniMaxH3VideoVAE.decode_temporal": (vae.MiniMaxH3VideoVAE, "decode_temporal"),
           "comfy.sd.VAE.decode": (comfy.sd.VAE, "decode"), "comfy.sd.VAE.decode_tiled": (comfy.sd.VAE, "decode_tiled"),
           "execution.get_output_from_returns": (execution, "get_output_from_returns")}
originals = {n: getattr(o, a) for n, (o, a) in targets.items()}
pack = types.ModuleType("tp2pack"); pack.__path__ = [ROOT]; sys.modules["tp2pack"] = pack
state = importlib.import_module("tp2pack.nodes.state").STATE
state.env = importlib.import_module("tp2pack.tp2.collectives").TPEnv(0, 2, "127.0.0.1", 29511, 30.0)
mods = {m: importlib.import_module("tp2pack.nodes." + m) for m in ("loader", "text_encoder", "lora", "parallel", "run", "prompt_lifecycle", "vae_decode", "same_outputs")}
from tp2pack.nodes.patches import PATCHES
def install():
    mods["loader"].install_loader_hook(); mods["text_encoder"].install_text_encoder_hook(); mods["lora"].install_lora_hooks(); mods["parallel"].install_linear_input_act_patch()
    mods["run"].install_interrupt_deferral(); mods["prompt_lifecycle"].track_prompts(); mods["vae_decode"].install_parallel_vae_decode(); mods["same_outputs"].install_same_outputs()
install()
first = {n: getattr(o, a) for n, (o, a) in targets.items()}
install()  # a second activation changes nothing
out = {"names": PATCHES.names(),
       "replaced": [n for n in targets if first[n] is not originals[n]],
       "stable": all(getattr(o, a) is first[n] for n, (o, a) in targets.items())}
print("RESULT " + json.dumps(out))
"""


def test_every_patch_is_registered_once_and_listed():
    code = f"COMFYUI, ROOT = {COMFYUI_DIR!r}, {ROOT!r}\n" + SCRIPT
    res = subprocess.run([sys.executable, "-c", code], cwd=COMFYUI_DIR, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TP2_PARALLEL_VAE="1"))  # fmt: skip
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert res.returncode == 0 and line, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(line[len("RESULT ") :])
    assert sorted(out["names"]) == sorted(EXPECTED), out["names"]
    assert sorted(out["replaced"]) == sorted(EXPECTED) and out["stable"], out


CHAINED = r"""
import importlib, json, sys, types
sys.path.insert(0, COMFYUI)
sys.argv = ["main.py", "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import comfy.ops, comfy.sd
calls = []
def wrap(owner, attr):  # another pack's wrapper, installed before this one
    inner = getattr(owner, attr)
    def other(*args, **kwargs):
        calls.append(attr)
        return "other pack's result"
    other.inner = inner
    setattr(owner, attr, other)
    return other
others = {a: wrap(o, a) for o, a in ((comfy.sd, "load_diffusion_model"), (comfy.sd, "load_clip"), (comfy.ops, "linear_input_act"))}
pack = types.ModuleType("tp2pack"); pack.__path__ = [ROOT]; sys.modules["tp2pack"] = pack
state = importlib.import_module("tp2pack.nodes.state").STATE
state.env = importlib.import_module("tp2pack.tp2.settings").TPEnv(0, 2, "127.0.0.1", 29511, 30.0)
importlib.import_module("tp2pack.nodes.loader").install_loader_hook()
importlib.import_module("tp2pack.nodes.text_encoder").install_text_encoder_hook()
importlib.import_module("tp2pack.nodes.parallel").install_linear_input_act_patch()
ours = {a: getattr(o, a) for o, a in ((comfy.sd, "load_diffusion_model"), (comfy.sd, "load_clip"), (comfy.ops, "linear_input_act"))}
got = [comfy.sd.load_diffusion_model("not_h3.ckpt"), comfy.sd.load_clip(["not_h3.ckpt"]),
       comfy.ops.linear_input_act(torch_linear := __import__("torch").nn.Linear(2, 2), None, "swiglu")]
print("RESULT " + json.dumps({"pack_on_top": [a for a in ours if ours[a] is not others[a] and ours[a].__wrapped__ is others[a]],
                              "calls": calls, "results": got}))
"""


def test_the_pack_calls_a_wrapper_another_pack_installed_first():
    """Another pack wrapped comfy.sd.load_diffusion_model, load_clip and comfy.ops.linear_input_act before this
    one: the pack's patches sit on top and call that wrapper (not ComfyUI's function captured at import)."""
    code = f"COMFYUI, ROOT = {COMFYUI_DIR!r}, {ROOT!r}\n" + CHAINED
    res = subprocess.run([sys.executable, "-c", code], cwd=COMFYUI_DIR, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert res.returncode == 0 and line, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(line[len("RESULT ") :])
    names = ["load_diffusion_model", "load_clip", "linear_input_act"]
    assert out["pack_on_top"] == names, out
    assert out["calls"] == names and out["results"] == ["other pack's result"] * 3, out
