"""The DiT's compute dtype per GPU architecture (TP2_COMPUTE_DTYPE=auto|fp32|bf16), and why.

Below compute capability 8.0 (Turing and older) there are no bf16 tensor cores: bf16 is emulated (slower than fp32),
SDPA has no efficient bf16 kernel there, and fp16 overflows in the int8 layers' outputs; so `auto` picks fp32 there
and bf16 from 8.0 on (Ampere, Ada, Hopper). Imports nothing from `comfy`.
"""

from __future__ import annotations

BF16_FROM = (8, 0)  # the first compute capability with bf16 tensor cores


def choose_compute_dtype(capability: tuple[int, int] | None, setting: str = "auto") -> tuple[str, str]:
    """("fp32" | "bf16", why) for a GPU of compute `capability` (None: no GPU, the CPU) under TP2_COMPUTE_DTYPE."""
    if setting != "auto":
        return setting, f"TP2_COMPUTE_DTYPE={setting}"
    if capability is None:
        return "fp32", "auto: no CUDA GPU (the CPU computes in fp32)"
    cc = f"{capability[0]}.{capability[1]}"
    if tuple(capability) < BF16_FROM:
        return "fp32", (
            f"auto: compute capability {cc} < 8.0 has no bf16 tensor cores (bf16 would be emulated, "
            "slower than fp32, and SDPA would take its math path); set TP2_COMPUTE_DTYPE=bf16 to override"
        )
    return "bf16", f"auto: compute capability {cc} >= 8.0 has bf16 tensor cores"
