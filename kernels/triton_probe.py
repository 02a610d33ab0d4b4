"""Whether a Triton kernel really runs on a device and dtype: one real call on tiny inputs, once per process.

Whether a kernel compiles and runs depends on the GPU and the Triton build. A kernel module's `available(...)` asks
here; a failed probe is logged once with the reason and its callers keep the ops they would use without Triton, so
an optional fast path can never stop a run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl  # noqa: F401 - the kernel modules take both from here
except ImportError:  # CPU-only installs, Windows without triton: the kernels' callers keep their own ops
    triton = tl = None

log = logging.getLogger(__name__)
_results: dict[tuple[str, str, torch.dtype], bool] = {}


def runs(name: str, device: torch.device, dtype: torch.dtype, call: Callable[[torch.device, torch.dtype], None]) -> bool:
    """True once `call(device, dtype)` has run without an error on this device and dtype (cached). Only with Triton
    installed, on CUDA devices or on CPU under Triton's interpreter (TRITON_INTERPRET=1), which the CPU tests use."""
    if triton is None or not (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    key = (name, str(device), dtype)
    if key not in _results:
        try:
            call(device, dtype)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            _results[key] = True
        except Exception as e:  # noqa: BLE001 - any failure means "not on this device": the caller's fallback runs
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.warning(
                "minimax-h3-tp2: the Triton kernel %s does not run on %s in %s (%s); using the unfused ops", name, device, dtype, reason
            )
            _results[key] = False
    return _results[key]
