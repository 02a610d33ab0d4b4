"""kernels: which GEMM and attention implementations run, chosen over comfy-kitchen. No TP logic here."""

from .int8_gemm import INT8_KERNELS, Int8Gemm, KernelUnavailableError, select_int8_gemm

__all__ = ["INT8_KERNELS", "Int8Gemm", "KernelUnavailableError", "select_int8_gemm"]
