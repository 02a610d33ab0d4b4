"""The pack's own nodes (V3 schema): a TP status readout, and conditioning saved to and loaded from a file."""

from __future__ import annotations

import os

import folder_paths
from comfy_api.latest import io

from ..tp2.conditioning import load_conditioning, save_conditioning
from .status_api import status_text

CATEGORY = "MiniMax-H3 TP"
CONDITIONING_FOLDER = "h3_conditioning"


def register_conditioning_folder() -> None:
    """models/h3_conditioning/*.safetensors (cond [1, L, text_dim], optional token_tags [L])."""
    if CONDITIONING_FOLDER not in folder_paths.folder_names_and_paths:
        path = os.path.join(folder_paths.models_dir, CONDITIONING_FOLDER)
        folder_paths.folder_names_and_paths[CONDITIONING_FOLDER] = ([path], {".safetensors"})


class TP2Status(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="TP2Status",
            display_name="TP2 Status (MiniMax-H3)",
            category=CATEGORY,
            description="This rank's tensor-parallel state: rank, tp_size, plan, kernels, last rank agreement. Connect "
            "anything (e.g. the sampler's output) to 'after' so it runs after that node and reports its agreement.",
            inputs=[io.AnyType.Input("after", optional=True, tooltip="any output; this node then runs after the node that makes it")],
            outputs=[io.String.Output(display_name="status")],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return float("nan")  # never equal to itself: the state changes between prompts, so it never comes from the cache

    @classmethod
    def execute(cls, after=None) -> io.NodeOutput:
        text = status_text()
        return io.NodeOutput(text, ui={"text": [text]})


class LoadH3Conditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LoadH3Conditioning",
            display_name="Load H3 Conditioning (file)",
            category=CATEGORY,
            description="Conditioning from models/h3_conditioning/*.safetensors (cond [1, L, text_dim], optional token_tags [L]), "
            "so a workflow runs without the 32B text encoder.",
            inputs=[io.Combo.Input("file", options=folder_paths.get_filename_list(CONDITIONING_FOLDER))],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def validate_inputs(cls, file):
        if folder_paths.get_full_path(CONDITIONING_FOLDER, file) is None:
            return f"No conditioning file '{file}' in models/{CONDITIONING_FOLDER}/. Make one with scripts/make_tiny_h3.py --conditioning."
        return True

    @classmethod
    def execute(cls, file) -> io.NodeOutput:
        cond, tags = load_conditioning(folder_paths.get_full_path_or_raise(CONDITIONING_FOLDER, file))
        extra = {"minimax_token_tags": tags} if tags is not None else {}
        return io.NodeOutput([[cond, extra]])


class SaveH3Conditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SaveH3Conditioning",
            display_name="Save H3 Conditioning (file)",
            category=CATEGORY,
            description="Writes the conditioning (cond [1, L, text_dim] and its token tags) to output/PREFIX_NNNNN.safetensors; "
            "move it to models/h3_conditioning/ to reuse the encoding with 'Load H3 Conditioning' (no text encoder needed).",
            inputs=[io.Conditioning.Input("conditioning"), io.String.Input("filename_prefix", default="h3_conditioning/cond")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, conditioning, filename_prefix) -> io.NodeOutput:
        cond, extra = conditioning[0][0], conditioning[0][1]
        folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(filename_prefix, folder_paths.get_output_directory())
        filename = f"{name}_{counter:05}.safetensors"
        save_conditioning(os.path.join(folder, filename), cond, extra.get("minimax_token_tags"))
        return io.NodeOutput(ui={"conditioning": [{"filename": filename, "subfolder": subfolder, "type": "output"}]})


NODES = [TP2Status, LoadH3Conditioning, SaveH3Conditioning]
