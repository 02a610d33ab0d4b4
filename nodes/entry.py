"""The pack's V3 extension. Importing it activates TP on this rank when TP2_RANK / TP2_WORLD_SIZE are set,
and changes nothing when they are not."""

from __future__ import annotations

import threading
import time
import uuid

import comfy.memory_management
import comfy.model_management
import torch
from comfy_api.latest import ComfyExtension
from server import PromptServer

from ..kernels import select_int8_gemm, wire_codec
from ..tp2 import settings
from ..tp2.capacity import allocator_of
from ..tp2.session import TPSession
from ..tp2.split import parse_split
from ..tp2.wire import use_fused
from .front_door import install_front_door, read_secret
from .pack_nodes import NODES, register_conditioning_folder
from .state import STATE, log
from .status_api import install_status_routes, resolved_settings, split_named


def activate() -> None:
    """Read the TP env; when present, create this rank's session and install the hooks (once)."""
    if STATE.active:
        return
    env = settings.read_tp_env()
    if env is None:
        log.info(
            "minimax-h3-tp2: tensor parallelism is off in this ComfyUI (not started as a rank); start one ComfyUI per GPU "
            "with <pack>/scripts/start-tp2.sh (README: Start, queue, watch, stop)"
        )
        return
    settings.freeze()  # every setting read once, now: a bad value is refused at start-up
    device = comfy.model_management.get_torch_device()
    STATE.env, STATE.device = env, device if device.type == "cuda" else torch.device("cpu")
    STATE.shares = parse_split(settings.value("TP2_SPLIT"), env.tp_size)
    STATE.int8_gemm = select_int8_gemm(settings.value("TP2_INT8_KERNEL"))
    STATE.reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[settings.value("TP2_REDUCE_DTYPE")]  # bf16: half the bytes
    use_fused(wire_codec.select)
    STATE.session = TPSession(env, STATE.device, boot_id=uuid.uuid4().hex, secret=read_secret(), peer_urls=settings.value("TP2_RANK_URLS"))
    _install_hooks()
    threading.Thread(target=_register_boot, name="tp2-boot", daemon=True).start()
    # the settings as "name value" ("sequence parallel:" is the sequence-parallel forward's own log line)
    log.info("%s minimax-h3-tp2 active: MASTER %s:%d, split %s; %s", STATE.tag, env.master_addr, env.master_port, split_named(),
             "; ".join(f"{k} {v}" for k, v in resolved_settings().items()))  # fmt: skip
    _warn_if_dynamic_vram_cannot_evict()


def _install_hooks() -> None:
    """Every change the pack makes to ComfyUI (nodes/patches.py lists them), and its routes."""
    from .loader import install_loader_hook
    from .lora import install_lora_hooks
    from .parallel import install_linear_input_act_patch
    from .prompt_lifecycle import track_prompts
    from .run import install_interrupt_deferral
    from .same_outputs import install_same_outputs
    from .text_encoder import install_text_encoder_hook
    from .vae_decode import install_parallel_vae_decode

    install_loader_hook()
    install_text_encoder_hook()
    install_lora_hooks()
    install_linear_input_act_patch()
    track_prompts()
    install_interrupt_deferral()
    install_front_door()
    install_status_routes(PromptServer.instance.routes)  # read-only GETs, with or without the front door
    install_parallel_vae_decode()
    install_same_outputs()


def _warn_if_dynamic_vram_cannot_evict() -> None:
    """Dynamic VRAM frees weights when a cudaMalloc or cudaMallocAsync call finds no room; expandable segments map
    torch's memory by other calls, so under them an out-of-memory comes where weights could have made room."""
    conf = settings.torch_allocator_conf()
    if comfy.memory_management.aimdo_enabled and allocator_of(torch.cuda.get_allocator_backend(), conf) == "expandable":
        log.warning("%s PYTORCH_CUDA_ALLOC_CONF=%s turns on expandable segments, which ComfyUI's dynamic VRAM cannot free weights "
                    "for: long videos may run out of GPU memory with models still resident. Remove expandable_segments from it "
                    "(the launcher's --lean-memory uses torch's allocator without them).", STATE.tag, conf)  # fmt: skip


def _register_boot() -> None:
    """Publish this process's boot id in the rank store, retrying until rank 0 (which hosts it) is up."""
    deadline = time.monotonic() + STATE.env.timeout_s
    while time.monotonic() < deadline:
        try:
            STATE.session.register_boot(timeout_s=10)
            STATE.boot_registered.set()
            STATE.session.watcher.start()
            return
        except Exception as e:  # noqa: BLE001 - rank 0 not up yet: retry
            last = e
            time.sleep(1.0)
    log.warning(
        "%s cannot register this boot in the rank store (%s); cache clearing after restarts relies on rendezvous errors", STATE.tag, last
    )
    STATE.session.watcher.start()  # it keeps trying the store


class TP2Extension(ComfyExtension):
    async def on_load(self) -> None:
        activate()

    async def get_node_list(self):
        return NODES


async def comfy_entrypoint() -> TP2Extension:
    register_conditioning_folder()
    return TP2Extension()
