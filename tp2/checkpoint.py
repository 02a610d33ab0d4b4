"""What a checkpoint is made of, without its weights: tensor names, dtypes, shapes, quantisation configs; and a
MiniMax-H3 DiT recognised from them (`H3Shape`: its key prefix, adaln form and widths).

`CheckpointLayout` is all the plan needs: a file's safetensors header plus the few bytes of each `.comfy_quant` marker
(tests build one from the real H3 layout kept as JSON). The DiT's dims are never hard-coded: they come from blocks.0's
shapes, the way ComfyUI's own detection reads them; a file that is not an H3 DiT, is incomplete, or is already a rank's
slice is refused. Imports torch only through `safetensors_io`; never `comfy`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .errors import PlanError, UnknownPrefixError
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

    @classmethod
    def from_file(cls, path: str) -> CheckpointLayout:
        """Read the header and the quant configs (`.comfy_quant` markers, a few dozen bytes each); no weights are read."""
        with TensorReader(path) as reader:
            header = reader.header
            raw = header.metadata.get(QUANT_METADATA_KEY)
            try:  # ComfyUI's alternative to markers: every layer's config in one header entry
                layers = json.loads(raw).get("layers", {}) if raw else {}
            except (ValueError, AttributeError) as e:
                raise PlanError(f"'{QUANT_METADATA_KEY}' in '{path}' is not a JSON object with 'layers' ({e}). The file is damaged.") from e
            quant = {n: _parse_quant_json(json.dumps(c), f"{QUANT_METADATA_KEY}[{n}]", path) for n, c in layers.items()}
            for name in header.tensors:
                if name.endswith(QUANT_SUFFIX):
                    raw = bytes(reader.read(name).numpy().tobytes())
                    quant[name[: -len(QUANT_SUFFIX)]] = _parse_quant_json(raw, name, path)
        tensors = {n: (t.dtype, t.shape) for n, t in header.tensors.items()}
        return cls(tensors, dict(header.metadata), quant, path)


def _parse_quant_json(raw: bytes | str, where: str, path: str) -> dict:
    try:
        conf = json.loads(raw)
    except ValueError as e:
        raise PlanError(f"Quantisation marker '{where}' in '{path}' is not valid JSON ({e}). The file is damaged; re-download it.") from e
    if not isinstance(conf, dict) or "format" not in conf:
        raise PlanError(f"Quantisation marker '{where}' in '{path}' has no 'format' field: {conf!r}. The file is damaged; re-download it.")
    return conf


def convrot_group(conf: dict | None) -> int | None:
    """The ConvRot group size of a layer's quant config, or None when the layer is not rotated."""
    if not conf:
        return None
    params = conf.get("params", {}) if isinstance(conf.get("params"), dict) else {}
    if not conf.get("convrot", params.get("convrot", False)):
        return None
    return int(conf.get("convrot_groupsize", params.get("convrot_groupsize", 256)))


H3_REQUIRED = (
    "video_patch_proj.weight",
    "audio_patch_proj.weight",
    "condition_proj.weight",
    "blocks.0.attn.qkv_proj.weight",
    "blocks.0.attn.q_norm.weight",
    "blocks.0.attn.out_proj.weight",
    "blocks.0.mlp.fc1.weight",
    "blocks.0.mlp.fc2.weight",
    "final_layer.video_out.weight",
)
# every prefix ComfyUI's loader strips from a diffusion model (comfy/model_detection.py unet_prefix_from_state_dict), and bare keys
KNOWN_PREFIXES = ("", "model.diffusion_model.", "diffusion_model.", "model.model.", "net.", "model.")


@dataclass(frozen=True)
class H3Shape:
    prefix: str
    adaln_form: str  # "full" (time_embedder + big adaln) or "curve" (adaln_t_table)
    hidden: int
    head_dim: int
    heads: int
    ffn: int
    t_dim: int  # the adaln input width

    @classmethod
    def of(cls, layout: CheckpointLayout) -> H3Shape:
        """Read it, or raise PlanError saying what the file is instead."""
        prefix = find_prefix(layout)
        if any(k.startswith(TP_METADATA_PREFIX) for k in layout.metadata):
            raise PlanError(
                f"'{layout.source}' is already a tensor-parallel shard (rank {layout.metadata.get('tp2.tp_rank')} of "
                f"{layout.metadata.get('tp2.tp_size')}); it cannot be sliced again. Select the original "
                "checkpoint: each rank finds its own cut in the rank cache (python -m tp2.rank_cache)."
            )
        shape = lambda k: layout.tensors[prefix + k][1]  # noqa: E731
        if prefix + "adaln_t_table" in layout.tensors:
            form, t_dim = "curve", shape("adaln_t_table")[1]
        elif prefix + "time_embedder.proj_out.weight" in layout.tensors:
            form, t_dim = "full", shape("time_embedder.proj_out.weight")[0]
        else:
            raise PlanError(
                f"'{layout.source}' has neither 'adaln_t_table' (curve form) nor 'time_embedder.proj_out.weight' "
                "(full form): cannot tell how its timestep conditioning works. Use an unmodified H3 checkpoint."
            )
        head_dim = shape("blocks.0.attn.q_norm.weight")[0]
        heads = shape("blocks.0.attn.qkv_proj.weight")[0] // (3 * head_dim)
        return cls(prefix, form, shape("video_patch_proj.weight")[0], head_dim, heads, shape("blocks.0.mlp.fc1.weight")[0] // 2, t_dim)

    def block_shapes(self) -> dict[str, tuple[int, int]]:
        """Every block's linear weights, by the key after 'blocks.N.'."""
        qkv = self.heads * self.head_dim
        return {
            "attn.qkv_proj.weight": (3 * qkv, self.hidden),
            "attn.out_proj.weight": (self.hidden, qkv),
            "mlp.fc1.weight": (2 * self.ffn, self.hidden),
            "mlp.fc2.weight": (self.hidden, self.ffn),
        }


def find_prefix(layout: CheckpointLayout) -> str:
    """The key prefix under which the H3 DiT sits, or raise PlanError when this is not an H3 DiT."""
    for prefix in KNOWN_PREFIXES:
        if f"{prefix}video_patch_proj.weight" in layout.tensors and f"{prefix}audio_patch_proj.weight" in layout.tensors:
            missing = [k for k in H3_REQUIRED if prefix + k not in layout.tensors]
            if missing:
                raise PlanError(
                    f"'{layout.source}' looks like MiniMax-H3 but lacks {', '.join(missing)}: the file is incomplete "
                    "or a different model. Use a complete MiniMax-H3 diffusion model file."
                )
            return prefix
    elsewhere = sorted({k[: -len("video_patch_proj.weight")] for k in layout.tensors if k.endswith("video_patch_proj.weight")})
    if elsewhere:
        raise UnknownPrefixError(
            f"'{layout.source}' holds a MiniMax-H3 model under the key prefix '{elsewhere[0]}', which this pack does not "
            f"know (it knows {', '.join(repr(p) for p in KNOWN_PREFIXES)}): refused rather than run whole on every rank. "
            "Re-save the file with one of those prefixes, or report the file's origin."
        )
    raise PlanError(
        f"'{layout.source}' is not a MiniMax-H3 diffusion model: it has no 'video_patch_proj.weight' and "
        "'audio_patch_proj.weight'. Load other models with the stock loader; TP applies to H3 only."
    )
