"""What a checkpoint is made of, without its weights: tensor names, dtypes, shapes, quantisation configs.

`CheckpointLayout` is all the plan needs. It comes from a file (the safetensors header plus the few bytes of
each `.comfy_quant` marker), or from a JSON description (tests keep the real H3 layout that way).
Imports torch only through `safetensors_io`; never `comfy`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .errors import PlanError
from .safetensors_io import TensorReader

QUANT_SUFFIX = ".comfy_quant"
QUANT_METADATA_KEY = "_quantization_metadata"
# Metadata keys the rank cache (tp2.rank_cache) writes into its files; a file carrying them is already sliced.
TP_METADATA_PREFIX = "tp2."


@dataclass(frozen=True)
class CheckpointLayout:
    """Names -> (safetensors dtype code, shape), string metadata, and per-layer quant configs."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    metadata: dict[str, str] = field(default_factory=dict)
    quant: dict[str, dict] = field(default_factory=dict)  # layer name (no suffix) -> {"format": ..., ...}
    source: str = "<memory>"

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    @classmethod
    def from_file(cls, path: str) -> CheckpointLayout:
        """Read the header and the `.comfy_quant` markers (a few dozen bytes each); no weights are read."""
        with TensorReader(path) as reader:
            header = reader.header
            quant = parse_quant_metadata(header.metadata, path)
            for name in header.tensors:
                if name.endswith(QUANT_SUFFIX):
                    raw = bytes(reader.read(name).numpy().tobytes())
                    quant[name[: -len(QUANT_SUFFIX)]] = _parse_quant_json(raw, name, path)
        tensors = {n: (t.dtype, t.shape) for n, t in header.tensors.items()}
        return cls(tensors, dict(header.metadata), quant, path)

    @classmethod
    def from_json(cls, doc: dict) -> CheckpointLayout:
        tensors = {n: (d, tuple(s)) for n, (d, s) in doc["tensors"].items()}
        return cls(tensors, dict(doc.get("metadata", {})), dict(doc.get("quant", {})), doc.get("source", "<json>"))


def _parse_quant_json(raw: bytes | str, where: str, path: str) -> dict:
    try:
        conf = json.loads(raw)
    except ValueError as e:
        raise PlanError(f"Quantisation marker '{where}' in '{path}' is not valid JSON ({e}). The file is damaged; re-download it.") from e
    if not isinstance(conf, dict) or "format" not in conf:
        raise PlanError(f"Quantisation marker '{where}' in '{path}' has no 'format' field: {conf!r}. The file is damaged; re-download it.")
    return conf


def parse_quant_metadata(metadata: dict[str, str], path: str) -> dict[str, dict]:
    """Per-layer configs from the `_quantization_metadata` header entry (ComfyUI's alternative to markers)."""
    raw = metadata.get(QUANT_METADATA_KEY)
    if not raw:
        return {}
    try:
        layers = json.loads(raw).get("layers", {})
    except (ValueError, AttributeError) as e:
        raise PlanError(f"'{QUANT_METADATA_KEY}' in '{path}' is not a JSON object with 'layers' ({e}). The file is damaged.") from e
    return {name: _parse_quant_json(json.dumps(conf), f"{QUANT_METADATA_KEY}[{name}]", path) for name, conf in layers.items()}


def convrot_group(conf: dict | None) -> int | None:
    """The ConvRot group size of a layer's quant config, or None when the layer is not rotated."""
    if not conf:
        return None
    params = conf.get("params", {}) if isinstance(conf.get("params"), dict) else {}
    if not conf.get("convrot", params.get("convrot", False)):
        return None
    return int(conf.get("convrot_groupsize", params.get("convrot_groupsize", 256)))
