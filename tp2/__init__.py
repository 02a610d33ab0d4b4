"""tp2: the ComfyUI-agnostic tensor-parallel core of minimax-h3-tp2.

Plan (`plan`), checkpoint layout and shard-on-read (`checkpoint`, `safetensors_io`, `shard`), parallel
linears (`layers`), process groups and collectives (`dist`), and the rank handshake (`handshake`).
Nothing in this package imports `comfy`; a test enforces it.
"""

__version__ = "0.1.0"
