"""comfy-kitchen's int8 linear in its two halves, so activations can travel quantised between them.

`int8_linear(x, W)` quantises x row by row (ConvRot-rotated, one fp32 scale per row) and multiplies. Row-wise
quantisation is row-independent, so a rank can quantise its own rows, ship int8 rows plus scales, and multiply the
gathered rows: `gemm(*quantize(x)) == int8_linear(x)` bit for bit, each half calling the kernel int8_linear calls.

    split = split_int8_linear(x, (N, K), group)   # None where the halves cannot be matched to int8_linear exactly
    q, s = split.quantize(x)                      # int8 [M, K], fp32 [M, 1]
    y = split.gemm(q, s, w_qdata, w_scale, bias, out_dtype)   # == int8_linear(x, w_qdata, w_scale, bias, ...)

Backends: comfy-kitchen's CUDA backend and its eager backend (CPU). The CUDA half reaches into comfy-kitchen's
backend module, so `split_int8_linear` returns None unless every entry point is there.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

_CUDA_NEEDS = (
    "_C", "_CONVROT_FUSED_MAX_K", "_convrot_fused_shared_memory_fits", "quantize_int8_rowwise_convrot64",
    "_int8_weight_scale_arg", "_empty_cuda_tensor", "_prefer_turing_fused_int8", "_cuda_device_should_use_turing_kernels",
    "_int8_linear_turing_quantized", "_prefer_cublas_int8_fallback", "_cuda_device_supports_cutlass_int8_dequant",
    "_cuda_device_is_turing", "_round_up", "_cublas_int8_n_alignment", "_pad_2d_cols", "_pad_2d_rows",
    "get_cublas_workspace", "_wrap_for_dlpack", "DTYPE_TO_CODE",
)  # fmt: skip
_EAGER_NEEDS = ("_build_hadamard", "_rotate_activation", "quantize_int8_rowwise", "_int8_matmul_accumulate")
_warned: set[str] = set()


@dataclass(frozen=True)
class SplitInt8Linear:
    """The two halves of int8_linear for one backend and ConvRot group."""

    backend: str
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    gemm: Callable[..., torch.Tensor]


def _backend_module(name: str, needs: tuple[str, ...]):
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure means: not available here
        return None, f"{name} does not import ({type(e).__name__}: {e})"
    missing = [n for n in needs if not hasattr(mod, n)]
    return (None, f"{name} lacks {', '.join(missing)}") if missing else (mod, "")


def _int8_linear_backend(x: torch.Tensor, w_shape: tuple[int, int], group: int) -> str:
    """The comfy-kitchen backend int8_linear picks for such a call (the registry's own choice)."""
    from comfy_kitchen import registry

    w_qdata = torch.empty(w_shape, dtype=torch.int8, device=x.device)
    w_scale = torch.ones((w_shape[0], 1), dtype=torch.float32, device=x.device)
    probe = dict(
        x=x, weight=w_qdata, weight_scale=w_scale, bias=None, out_dtype=x.dtype, convrot=True, convrot_groupsize=group, input_act=None
    )  # fmt: skip
    impl = registry.get_implementation("int8_linear", kwargs=probe)
    parts = impl.__module__.split(".")  # comfy_kitchen.backends.<name>[.module]
    return parts[2] if parts[:2] == ["comfy_kitchen", "backends"] and len(parts) > 2 else impl.__module__


_cache: dict[tuple, SplitInt8Linear | None] = {}


def split_int8_linear(x: torch.Tensor, w_shape: tuple[int, int], group: int) -> SplitInt8Linear | None:
    """The halves for int8_linear(x, an int8 [N, K] weight, ConvRot group `group`), or None (the reason logged once);
    decided once per device, dtype, weight shape and group."""
    key = (x.device, x.dtype, tuple(w_shape), group)
    if key not in _cache:
        _cache[key] = _split_for(x, tuple(w_shape), group)
    return _cache[key]


def _split_for(x, w_shape, group) -> SplitInt8Linear | None:
    backend = _int8_linear_backend(x, w_shape, group)
    if backend == "cuda":
        mod, why = _backend_module("comfy_kitchen.backends.cuda", _CUDA_NEEDS)
        k = x.shape[-1]
        if mod is not None and not (group == 256 and k % 256 == 0 and 256 <= k <= mod._CONVROT_FUSED_MAX_K):
            mod, why = None, f"ConvRot group {group} with K={k} is not on the fused quantiser's path"
        if mod is not None and not mod._convrot_fused_shared_memory_fits(x.reshape(-1, k), k, group):
            mod, why = None, f"the fused quantiser does not fit K={k} in shared memory on {x.device}"
        if mod is not None:
            return SplitInt8Linear("cuda", lambda t: _cuda_quantize(mod, t, group), lambda *a: _cuda_gemm(mod, *a))
    elif backend == "eager":
        mod, why = _backend_module("comfy_kitchen.backends.eager.quantization", _EAGER_NEEDS)
        if mod is not None:
            return SplitInt8Linear("eager", lambda t: _eager_quantize(mod, t, group), lambda *a: _eager_gemm(mod, *a))
    else:
        why = f"int8_linear runs on comfy-kitchen's '{backend}' backend here, which has no split form in this pack"
    if why not in _warned:
        _warned.add(why)
        log.info("int8 activations travel as bf16, not int8: %s", why)
    return None


def _cuda_quantize(mod, x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    # int8_linear's fused branch: the same kernel, no input activation, no stochastic rounding
    return mod.quantize_int8_rowwise_convrot64(x.reshape(-1, x.shape[-1]).contiguous(), group)


def _cuda_gemm(mod, q, q_scale, w, w_scale, bias, out_dtype) -> torch.Tensor:
    """int8_linear's M > 1 GEMM on already quantised rows: Turing kernel, else CUTLASS, else cuBLAS + dequant."""
    if q.shape[0] < 2:
        raise ValueError("the split int8 GEMM needs at least 2 rows (int8_linear takes a GEMV path for one row)")
    (m, k), n = q.shape, w.shape[0]
    dev, index, stream = q.device, q.get_device(), torch.cuda.current_stream(q.device).cuda_stream
    w = w.contiguous()
    w_scale = mod._int8_weight_scale_arg(w_scale, dev)
    bias_arg = mod._empty_cuda_tensor(dev, out_dtype) if bias is None else bias.to(device=dev, dtype=out_dtype).contiguous()
    turing = mod._prefer_turing_fused_int8(m, n, k) and mod._cuda_device_should_use_turing_kernels(index)
    if turing and hasattr(mod._C, "cutlass_turing_int8_dequant"):
        y = mod._int8_linear_turing_quantized(q, w, q_scale, w_scale, None if bias is None else bias_arg, out_dtype)
        if y is not None:
            return y
    out = torch.empty((m, n), dtype=out_dtype, device=dev)
    code, wrap = mod.DTYPE_TO_CODE[out_dtype], mod._wrap_for_dlpack
    cutlass_ok = not mod._prefer_cublas_int8_fallback(m, n, k, index) and not getattr(mod, "_DISABLE_CUTLASS_INT8", False)
    if cutlass_ok and mod._cuda_device_supports_cutlass_int8_dequant(q):
        per_n = w_scale if w_scale.numel() == n else w_scale.expand(n).contiguous()
        bias32 = bias_arg if bias is None else bias_arg.to(torch.float32).contiguous()
        if mod._C.cutlass_int8_dequant(wrap(q), wrap(w), wrap(q_scale), wrap(per_n), wrap(bias32), wrap(out), code, stream):
            return out
    qa, wa, n_pad = q, w, n
    if mod._cuda_device_is_turing(index):  # cuBLAS int8 alignment on Turing
        n_pad = mod._round_up(n, mod._cublas_int8_n_alignment(q))
        qa = mod._pad_2d_cols(q, mod._round_up(k, 16))
        wa = mod._pad_2d_rows(mod._pad_2d_cols(w, mod._round_up(k, 16)), n_pad)
    acc = torch.empty((m, n_pad), dtype=torch.int32, device=dev)
    mod._C.cublas_gemm_int8(wrap(qa), wrap(wa), wrap(acc), wrap(mod.get_cublas_workspace()), stream)
    if n_pad != n:
        acc = acc[:, :n].contiguous()
    mod._C.dequantize_int8_linear(wrap(acc), wrap(q_scale), wrap(w_scale), wrap(bias_arg), wrap(out), code, stream)
    return out


def _eager_quantize(mod, x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    rotated = mod._rotate_activation(x, mod._build_hadamard(group, device=x.device, dtype=x.dtype), group)
    return mod.quantize_int8_rowwise(rotated.reshape(-1, x.shape[-1]))


def _eager_gemm(mod, q, q_scale, w, w_scale, bias, out_dtype) -> torch.Tensor:
    acc = mod._int8_matmul_accumulate(q, w.to(q.device).contiguous().T.contiguous())
    scales = q_scale.to(torch.float32) * w_scale.to(device=q.device, dtype=torch.float32).reshape(1, -1)
    y = (acc.float() * scales).to(out_dtype)
    return y if bias is None else y + bias.to(device=y.device, dtype=y.dtype).reshape(1, -1)
