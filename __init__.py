"""minimax-h3-tp2: tensor-parallel MiniMax-H3 for ComfyUI (custom node pack entry point).

Inside ComfyUI this exposes `comfy_entrypoint` (V3). Imported anywhere else (tests, tools), it does nothing:
the ComfyUI-agnostic core lives in `tp2/` and `kernels/`.
"""

try:
    import comfy_api.latest  # noqa: F401 - present only inside ComfyUI
except ImportError:
    comfy_entrypoint = None
else:
    from .nodes.entry import comfy_entrypoint

WEB_DIRECTORY = "./web"  # the rank banner (web/tp2_rank_banner.js): a follower's UI links rank 0

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
