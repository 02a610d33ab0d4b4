"""Attention backend choice per device: `TP2_ATTN_BACKEND` = auto | ck | sdpa.

The candidates are callables handed in by the caller (ComfyUI's own attention functions): no ComfyUI import here.
`auto` times each available candidate once per device and dtype and keeps the fastest, but never SDPA where it would
take its math path (the whole score matrix in memory) while another candidate runs. A forced backend that cannot run
here is an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from .int8_gemm import KernelUnavailableError

log = logging.getLogger(__name__)

ENV_ATTN_BACKEND = "TP2_ATTN_BACKEND"  # auto | ck | sdpa, checked by tp2.settings

PROBE_SHAPE = (8, 4096, 128)  # (heads, tokens, head_dim) of the timing problem
_chosen: dict[tuple[str, str, str], str] = {}


def sdpa_materialises_scores(capability: tuple[int, int] | None, dtype: torch.dtype) -> bool:
    """Whether torch's SDPA takes its math path (the full score matrix) on a GPU of this compute capability: flash
    and memory-efficient attention take bf16 only from 8.0; fp32 and fp16 have the memory-efficient kernel."""
    return capability is not None and dtype == torch.bfloat16 and tuple(capability) < (8, 0)


def _time_once(fn: Callable, q, k, v, heads: int, repeats: int = 3) -> float:
    fn(q, k, v, heads)  # warm-up (kernel selection, compilation)
    if q.is_cuda:
        torch.cuda.synchronize(q.device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(q, k, v, heads)
    if q.is_cuda:
        torch.cuda.synchronize(q.device)
    return (time.perf_counter() - t0) / repeats


def select_attention(
    candidates: dict[str, tuple[Callable | None, str]], device: torch.device, name: str = "auto", dtype: torch.dtype = torch.bfloat16
) -> str:
    """Pick a backend name from `candidates` ({name: (fn(q, k, v, heads) or None, why unavailable)}), timed in
    `dtype` (the model's compute dtype); logs the choice once per device and dtype."""
    key = (name, str(device), str(dtype))
    if key in _chosen:
        return _chosen[key]
    usable = {n: fn for n, (fn, _) in candidates.items() if fn is not None}
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if name == "auto" and len(usable) > 1 and "sdpa" in usable and sdpa_materialises_scores(capability, dtype):
        del usable["sdpa"]  # fastest on a small problem, out of memory at a video's length
        candidates = dict(candidates, sdpa=(None, f"math path for {dtype} on compute capability {capability}"))
    if name != "auto":
        if name not in usable:
            why = candidates.get(name, (None, "unknown backend"))[1]
            raise KernelUnavailableError(f"{ENV_ATTN_BACKEND}={name} cannot run on {device}: {why}. Unset it (auto) or choose sdpa.")
        choice, detail = name, "forced"
    elif len(usable) == 1 or device.type != "cuda":
        choice = "sdpa" if "sdpa" in usable else next(iter(usable))
        skipped = ", ".join(f"{n}: {why}" for n, (fn, why) in candidates.items() if fn is None)
        detail = f"auto, no timing on {device.type}" + (f" ({skipped})" if skipped else "")
    else:
        h, s, d = PROBE_SHAPE
        q, k, v = (torch.randn(1, h, s, d, device=device, dtype=dtype) for _ in range(3))
        times = {n: _time_once(fn, q, k, v, h) for n, fn in usable.items()}
        choice = min(times, key=times.get)
        detail = "auto: " + ", ".join(f"{n} {1e3 * t:.2f} ms" for n, t in sorted(times.items()))
    log.info("attention backend on %s for %s: %s (%s)", device, dtype, choice, detail)
    _chosen[key] = choice
    return choice
