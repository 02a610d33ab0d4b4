"""The UNETLoader hook: H3 checkpoints load as this rank's shard; everything else loads untouched.

For an H3 safetensors file on an active rank, `comfy.sd.load_diffusion_model` reads only this rank's slices (or its rank file) and lets
ComfyUI's own `load_diffusion_model_state_dict` build the local-width model from the shapes (so the int8 mixed-precision path is picked as
without the pack), then tags, verifies and wires it. The model computes in the dtype tp2/compute_dtype.py picks (ComfyUI's manual cast
pinned to it while it is built); an int8 model runs only once this device's int8 path passed nodes/numerics_check.py.
"""

from __future__ import annotations

import functools
import os
import time

import comfy.memory_management
import comfy.model_management
import comfy.sd
import comfy.utils
import torch

from ..tp2 import settings
from ..tp2.checkpoint import CheckpointLayout, find_prefix
from ..tp2.compute_dtype import choose_compute_dtype
from ..tp2.errors import PlanError, UnknownPrefixError
from ..tp2.plan import ROWWISE_SPLIT_INPUT, Plan
from ..tp2.rank_cache import RankShard, open_rank_shard
from ..tp2.safetensors_io import read_header, read_tensors
from . import sequence_parallel
from .model_wrappers import install_model_wrappers
from .numerics_check import check_int8_path
from .parallel import tag_and_verify
from .patches import PATCHES, changes_of
from .state import STATE, LoadedModel, log


def is_h3_file(path: str) -> bool:
    """A cheap header probe: a safetensors file whose keys are a MiniMax-H3 DiT."""
    if not path.endswith((".safetensors", ".sft")):
        return False
    try:
        header = read_header(path)
        find_prefix(CheckpointLayout({n: (t.dtype, t.shape) for n, t in header.tensors.items()}, header.metadata, source=path))
        return True
    except UnknownPrefixError:
        raise  # H3, but not where we can split it: refused, never run whole on every rank
    except Exception:  # noqa: BLE001 - not H3 (PlanError), or unreadable: ComfyUI's to load or report
        return False


def open_shard(path: str) -> RankShard:
    """This rank's shard of an H3 DiT or text encoder file, through the rank cache as TP2_RANK_CACHE says. Without dynamic
    VRAM cache files are read by tp2's pread, not mapped: a mapped file that another process cuts short ends it (SIGBUS)."""
    mode, cache_dir = settings.value("TP2_RANK_CACHE"), settings.cache_dir()
    dynamic = comfy.memory_management.aimdo_enabled
    cached = os.path.join(cache_dir, "rank_cache", "")

    def read_all(file: str) -> dict:
        return read_tensors(file) if not dynamic and file.startswith(cached) else comfy.utils.load_torch_file(file, safe_load=True)

    cut = mode == "on" or (mode == "auto" and dynamic)
    return open_rank_shard(path, STATE.env.tp_rank, STATE.env.tp_size, None if mode == "off" else cache_dir, read_all, cut, STATE.shares)


def _hooked_load_diffusion_model(original):
    """comfy.sd.load_diffusion_model: H3 files as this rank's shard, everything else through `original`."""

    @functools.wraps(original)
    def load_diffusion_model(unet_path, model_options={}, disable_dynamic=False):  # noqa: B006 - ComfyUI's signature
        if not STATE.active or not is_h3_file(unet_path):
            return original(unet_path, model_options=model_options, disable_dynamic=disable_dynamic)
        t0 = time.monotonic()
        shard = open_shard(unet_path)
        sd, metadata, plan = shard.state_dict, shard.metadata, shard.plan
        split_input = _pop_split_input(sd, plan)
        _PINNED.append(_compute_dtype())  # ComfyUI's manual cast while it builds the model (_pinned_manual_cast)
        try:
            patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options, metadata=metadata, disable_dynamic=disable_dynamic)
        finally:
            _PINNED.pop()
        if patcher is None:
            raise PlanError(
                f"ComfyUI could not build a model from this rank's shard of '{os.path.basename(unet_path)}'. Report this with the file name."
            )
        dm = patcher.model.diffusion_model
        _assign_split_input(dm, split_input)
        patcher.model.tp2_plan = plan  # read by the LoRA hook (nodes/lora.py)
        tag_and_verify(dm, plan)
        if any(name.endswith(".comfy_quant") for name in plan.tensors):
            check_int8_path(patcher.model.get_dtype_inference())  # refuses a device whose int8 path measures wrong
        sp = settings.value("TP2_SEQUENCE_PARALLEL") and sequence_parallel.install(dm)  # at tp_size 1 too: the same kernels on one GPU
        if not sp:
            sequence_parallel.install_pipelined_blocks(dm)
        install_model_wrappers(patcher, plan, shard.source_fingerprint, sequence_parallel=sp)
        record_load("", unet_path, shard, t0, changes_of(dm))
        patcher.cached_patcher_init = (load_diffusion_model, (unet_path, model_options))
        return patcher

    return load_diffusion_model


def record_load(kind: str, path: str, shard: RankShard, t0: float, changes) -> None:
    """A loaded H3 model (DiT, or `kind` "text encoder ") in STATE.models, for the status readout, and in the log."""
    secs, name, plan = time.monotonic() - t0, os.path.basename(path), shard.plan
    fp, origin = shard.source_fingerprint, shard.origin
    STATE.models.append(LoadedModel(name, plan.summary(), plan.fingerprint(), fp, origin, secs, changes, plan.split()))
    log.info("%s loaded %s%s (%s) in %.1f s: %s", STATE.tag, kind, name, origin, secs, plan.summary())


def _compute_dtype() -> torch.dtype:
    """This rank's compute dtype (TP2_COMPUTE_DTYPE; ComfyUI's --force-fp32 counts as fp32), logged with why."""
    setting = settings.value("TP2_COMPUTE_DTYPE")
    capability = torch.cuda.get_device_capability(STATE.device) if STATE.device.type == "cuda" else None
    if setting == "auto" and comfy.model_management.FORCE_FP32:
        name, why = "fp32", "ComfyUI's --force-fp32"
    else:
        name, why = choose_compute_dtype(capability, setting)
    STATE.compute_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
    log.info("%s compute dtype %s on %s: %s", STATE.tag, name, STATE.device, why)
    return STATE.compute_dtype


_PINNED: list[torch.dtype] = []  # the compute dtype while ComfyUI builds an H3 DiT, else empty


def _pinned_manual_cast(original):
    """comfy.model_management.unet_manual_cast: the pinned dtype while an H3 DiT is built, else ComfyUI's choice."""

    @functools.wraps(original)
    def unet_manual_cast(weight_dtype, *args, **kwargs):
        if not _PINNED:
            return original(weight_dtype, *args, **kwargs)
        return None if weight_dtype == _PINNED[-1] else _PINNED[-1]

    return unet_manual_cast


def _pop_split_input(sd: dict, plan: Plan) -> dict[str, torch.Tensor]:
    """Full-form adaln weights (and their biases) are split along K; ComfyUI would build (and size-check) them at
    full K, so they are assigned after the build instead."""
    if plan.tp_size == 1:
        return {}
    layers = [layer for layer, style in plan.linears.items() if style == ROWWISE_SPLIT_INPUT]
    names = [plan.prefix + layer + suffix for layer in layers for suffix in (".weight", ".bias")]
    return {n[len(plan.prefix) :]: sd.pop(n) for n in names if n in sd}


def _assign_split_input(dm: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """The split-input layers' (full-form adaln) K slice and bias, in the dtype and on the device ComfyUI chose; a layer
    built with weight None (mixed-precision ops: an int8 file) takes its compute dtype and the model's device."""
    home = next((p.device for p in dm.parameters() if p is not None), torch.device("cpu"))
    for name, t in tensors.items():
        layer, attr = name.rsplit(".", 1)
        module = dm.get_submodule(layer)
        old = getattr(module, attr, None)
        if old is not None:
            device, dtype = old.device, old.dtype
        else:
            device, dtype = home, getattr(module, "factory_kwargs", {}).get("dtype") or t.dtype
        setattr(module, attr, torch.nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False))


def install_loader_hook() -> None:
    PATCHES.install(comfy.sd, "load_diffusion_model", _hooked_load_diffusion_model)
    PATCHES.install(comfy.model_management, "unet_manual_cast", _pinned_manual_cast)
