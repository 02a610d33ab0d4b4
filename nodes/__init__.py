"""nodes: the only part of the pack that imports `comfy` / `comfy_api`; each module is thin over `tp2` and `kernels`
and says what it owns (`entry` activates the pack, `patches` lists every change it makes to ComfyUI)."""
