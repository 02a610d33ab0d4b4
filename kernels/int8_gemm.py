"""The int8 GEMM path: comfy-kitchen's `int8_linear` through its backend registry, or one backend forced.

`TP2_INT8_KERNEL` = auto (the registry picks per call: CUDA/CUTLASS on GPUs, eager elsewhere) | cuda | triton |
eager. The choice is logged once per process; a forced backend that cannot run here is an error at selection time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

ENV_INT8_KERNEL = "TP2_INT8_KERNEL"
INT8_KERNELS = ("auto", "cuda", "triton", "eager")

# (x, qdata, scale, bias, out_dtype, convrot_group or None, input_act or None) -> y
Int8Gemm = Callable[..., torch.Tensor]

_selected: dict[str, Int8Gemm] = {}


class KernelUnavailableError(RuntimeError):
    """The requested kernel (the int8 GEMM's or attention's) cannot run on this device."""


def _unavailable(name: str, why: str) -> KernelUnavailableError:
    return KernelUnavailableError(
        f"{ENV_INT8_KERNEL}={name} cannot run on this machine: {why}. Unset {ENV_INT8_KERNEL} (auto) or choose one of "
        f"{', '.join(INT8_KERNELS)} that this device supports."
    )


def select_int8_gemm(name: str = "auto") -> Int8Gemm:
    """The int8 GEMM callable for `name` (the pack passes TP2_INT8_KERNEL's value), validated and logged once."""
    if name in _selected:
        return _selected[name]
    from comfy_kitchen import registry

    if name != "auto":
        info = registry.list_backends().get(name)
        if info is None or not info["available"]:
            raise _unavailable(name, (info or {}).get("unavailable_reason") or "backend not registered")
        if info.get("disabled"):
            hint = " (ComfyUI disables it unless started with --enable-triton-backend)" if name == "triton" else ""
            raise _unavailable(name, f"comfy-kitchen's {name} backend is disabled{hint}")
        if "int8_linear" not in info["capabilities"]:
            raise _unavailable(name, "this comfy-kitchen backend has no int8_linear")

    def gemm(x, qdata, scale, bias=None, out_dtype=torch.float32, convrot_group=None, input_act=None):
        # only the arguments every comfy-kitchen >= 0.2.31 accepts
        kwargs = dict(
            x=x, weight=qdata, weight_scale=scale, bias=bias, out_dtype=out_dtype,
            convrot=convrot_group is not None, convrot_groupsize=convrot_group or 256, input_act=input_act,
        )  # fmt: skip
        impl = registry.get_implementation("int8_linear", backend=None if name == "auto" else name, kwargs=kwargs)
        return impl(**kwargs)

    gemm.kernel_name = name  # type: ignore[attr-defined]
    available = [b for b, i in registry.list_backends().items() if i["available"] and "int8_linear" in i["capabilities"]]
    log.info("int8 GEMM: comfy-kitchen int8_linear, kernel=%s (backends able to run it here: %s)", name, ", ".join(available))
    _selected[name] = gemm
    return gemm


def quantize_int8_convrot(w: torch.Tensor, group: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as an int8 ConvRot checkpoint stores it: rotated int8 qdata [N, K] and fp32 row scales
    [N, 1] (comfy-kitchen's own weight quantiser, the one the checkpoint converters use)."""
    from comfy_kitchen.tensor import QuantizedTensor

    qt = QuantizedTensor.from_float(
        w.float(), "TensorWiseINT8Layout", is_weight=True, per_channel=True, convrot=True, convrot_groupsize=group
    )
    sd = qt.state_dict("w")
    return sd["w"].contiguous(), sd["w_scale"].float().reshape(w.shape[0], 1).contiguous()
