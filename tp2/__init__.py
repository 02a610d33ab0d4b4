"""tp2: the ComfyUI-agnostic tensor-parallel core of minimax-h3-tp2 (plan, checkpoint and shards, parallel layers,
process groups and collectives, the rank session). Nothing in this package imports `comfy`; a test enforces it."""

__version__ = "0.1.0"
