"""What the GPU tests that run the pack inside ComfyUI share: the ComfyUI checkout ($COMFYUI_DIR, default
~/ComfyUI; on the device machine, the staged one), the marks of a test that needs a CUDA GPU and ComfyUI's H3, and
the pack imported as the package `tp2pack` without its ComfyUI entry point."""

from __future__ import annotations

import importlib
import os
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMFYUI_DIR = os.environ.get("COMFYUI_DIR", os.path.expanduser("~/ComfyUI"))
NEEDS_GPU_AND_H3 = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        not os.path.isfile(os.path.join(COMFYUI_DIR, "comfy", "ldm", "minimax", "model.py")), reason="needs ComfyUI with H3"
    ),
]


def pack_module(name: str):
    """`tp2pack.<name>` (e.g. "nodes.h3_attention"), with ComfyUI importable."""
    if COMFYUI_DIR not in sys.path:
        sys.path.insert(0, COMFYUI_DIR)
    if "tp2pack" not in sys.modules:
        pkg = types.ModuleType("tp2pack")
        pkg.__path__ = [ROOT]
        sys.modules["tp2pack"] = pkg
    return importlib.import_module(f"tp2pack.{name}")
