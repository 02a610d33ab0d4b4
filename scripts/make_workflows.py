#!/usr/bin/env python3
"""Generate the bundled workflows in both formats from one description per workflow.

    python scripts/make_workflows.py --object-info OBJECT_INFO.json   # or --url http://127.0.0.1:8188

Writes `workflows/<name>.json` (UI format: drag into ComfyUI; also listed in its template browser) and
`workflows/api/<name>.json` (API format, for scripts/tp2-submit). Widget order, socket types and output names
come from ComfyUI's own /object_info, so the UI files match what the frontend expects for that ComfyUI.
`ui_to_api` is the inverse used by the tests to prove that both forms agree.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", "COMFY_DYNAMICCOMBO_V3"}

# The common H3 release file names (see README's model table).
DIT = "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
TEXT_ENCODER = "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
VIDEO_VAE = "minimax_h3_video_vae_fp16.safetensors"
AUDIO_VAE = "minimax_h3_audio_vae_fp32.safetensors"
RELEASE = {DIT: "diffusion_models", TEXT_ENCODER: "text_encoders", VIDEO_VAE: "vae", AUDIO_VAE: "vae"}  # file -> models/ folder
DOWNLOAD = "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/{folder}/{name}"  # where ComfyUI's own H3 templates point
PROMPT = (
    "A red fox trots through fresh snow in a quiet birch forest at dawn, breath steaming, soft crunch of footsteps and distant birdsong."
)


def _t2v(width: int, height: int, name: str, first: bool = False, last: bool = False) -> dict:
    """Text (+ optional first/last frame) to video with audio: the reference settings (124 frames, 24 fps,
    8 steps res_multistep/simple, cfg 1, seed 145)."""
    g = {
        "1": ("UNETLoader", {"unet_name": DIT, "weight_dtype": "default"}),
        "2": ("CLIPLoader", {"clip_name": TEXT_ENCODER, "type": "minimax", "device": "default"}),
        "3": ("VAELoader", {"vae_name": VIDEO_VAE}),
        "4": ("VAELoader", {"vae_name": AUDIO_VAE}),
        "5": ("MiniMaxH3ImageToVideo", {"clip": ["2", 0], "vae": ["3", 0], "prompt": PROMPT, "width": width, "height": height, "length": 124}),
        "6": ("ConditioningZeroOut", {"conditioning": ["5", 0]}),
        "7": ("MiniMaxH3SigmaShift", {"model": ["1", 0], "shift_video": 12.0, "shift_audio": 3.0}),
        "8": ("KSampler", {"model": ["7", 0], "seed": 145, "steps": 8, "cfg": 1.0, "sampler_name": "res_multistep", "scheduler": "simple",
                           "positive": ["5", 0], "negative": ["6", 0], "latent_image": ["5", 1], "denoise": 1.0}),
        "9": ("VAEDecode", {"samples": ["8", 0], "vae": ["3", 0]}),
        "10": ("VAEDecodeAudio", {"samples": ["8", 0], "vae": ["4", 0]}),
        "11": ("CreateVideo", {"images": ["9", 0], "fps": 24.0, "audio": ["10", 0], "bit_depth": 8}),
        "12": ("SaveVideo", {"video": ["11", 0], "filename_prefix": f"video/{name}", "format": "auto", "codec": "auto"}),
    }  # fmt: skip
    if first:
        g["13"] = ("LoadImage", {"image": "h3_first_frame.png"})
        g["5"][1]["first_frame"] = ["13", 0]
    if last:
        g["14"] = ("LoadImage", {"image": "h3_last_frame.png"})
        g["5"][1]["last_frame"] = ["14", 0]
    return g


def _tiny() -> dict:
    """The synthetic-checkpoint demo: conditioning from file, no text encoder, latents saved, the video latent decoded
    by a small VAE (scripts/make_tiny_h3.py --vae) to an animated WEBP that the UI previews."""
    return {
        "1": ("UNETLoader", {"unet_name": "h3_tiny_int8.safetensors", "weight_dtype": "default"}),
        "2": ("LoadH3Conditioning", {"file": "h3_tiny_cond.safetensors"}),
        "3": ("ConditioningZeroOut", {"conditioning": ["2", 0]}),
        "4": ("EmptyMiniMaxH3LatentAV", {"width": 64, "height": 64, "length": 5}),
        "5": ("KSampler", {"model": ["1", 0], "seed": 145, "steps": 4, "cfg": 1.0, "sampler_name": "res_multistep", "scheduler": "simple",
                           "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}),
        "6": ("LTXVSeparateAVLatent", {"av_latent": ["5", 0]}),
        "7": ("SaveLatent", {"samples": ["6", 0], "filename_prefix": "latents/h3_tiny_demo_video"}),
        "8": ("SaveLatent", {"samples": ["6", 1], "filename_prefix": "latents/h3_tiny_demo_audio"}),
        "9": ("VAELoader", {"vae_name": "h3_tiny_vae.safetensors"}),
        "10": ("VAEDecode", {"samples": ["6", 0], "vae": ["9", 0]}),
        "11": ("SaveAnimatedWEBP", {"images": ["10", 0], "filename_prefix": "h3_tiny_demo", "fps": 5.0, "lossless": True, "quality": 80,
                                    "method": "default"}),
    }  # fmt: skip


WORKFLOWS = {
    "h3_tp2_t2v_832x480": _t2v(832, 480, "h3_tp2_t2v_832x480"),
    "h3_tp2_t2v_1344x768": _t2v(1344, 768, "h3_tp2_t2v_1344x768"),
    "h3_tp2_t2v_1600x896": _t2v(1600, 896, "h3_tp2_t2v_1600x896"),
    "h3_tp2_i2v_832x480": _t2v(832, 480, "h3_tp2_i2v_832x480", first=True),
    "h3_tp2_flf2v_832x480": _t2v(832, 480, "h3_tp2_flf2v_832x480", first=True, last=True),
    "h3_tp2_tiny_demo": _tiny(),
}


def to_api(graph: dict) -> dict:
    return {nid: {"class_type": cls, "inputs": dict(inputs)} for nid, (cls, inputs) in graph.items()}


def _spec(info: dict, cls: str) -> list[tuple[str, str, dict]]:
    """(input name, type, options) in ComfyUI's order: required, then optional."""
    out = []
    for section in ("required", "optional"):
        for name, spec in info[cls]["input"].get(section, {}).items():
            kind = spec[0]
            opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            out.append((name, "COMBO" if isinstance(kind, list) else kind, opts))
    return out


def to_ui(graph: dict, info: dict) -> dict:
    nodes, links = [], []
    by_id = {nid: {"id": int(nid), "outputs": []} for nid in graph}
    for order, (nid, (cls, inputs)) in enumerate(graph.items()):
        node = by_id[nid]
        node.update(type=cls, pos=[80 + 380 * (order % 4), 80 + 360 * (order // 4)], size=[340, 160], flags={}, order=order, mode=0)
        node["properties"] = {"Node name for S&R": cls}
        models = [
            {"name": v, "url": DOWNLOAD.format(folder=RELEASE[v], name=v), "directory": RELEASE[v]}
            for v in inputs.values()
            if isinstance(v, str) and v in RELEASE
        ]
        if models:  # ComfyUI's missing-models dialog offers these downloads
            node["properties"]["models"] = models
        node["inputs"], node["widgets_values"] = [], []
        for name, kind, opts in _spec(info, cls):
            value = inputs.get(name)
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                link_id = len(links) + 1
                src_type = info[graph[value[0]][0]]["output"][value[1]]
                links.append([link_id, int(value[0]), value[1], int(nid), len(node["inputs"]), src_type])
                node["inputs"].append({"name": name, "type": kind, "link": link_id})
            elif kind in WIDGET_TYPES:
                node["widgets_values"].append(value if name in inputs else opts.get("default"))
                if opts.get("control_after_generate"):
                    node["widgets_values"].append("fixed")
            elif kind not in WIDGET_TYPES:
                node["inputs"].append({"name": name, "type": kind, "link": None})
        outs = info[cls]["output"]
        names = info[cls].get("output_name") or outs
        node["outputs"] = [{"name": names[i], "type": t, "links": [], "slot_index": i} for i, t in enumerate(outs)]
        nodes.append(node)
    for link_id, src, slot, _dst, _dslot, _t in links:
        by_id[str(src)]["outputs"][slot]["links"].append(link_id)
    return {"last_node_id": max(n["id"] for n in nodes), "last_link_id": len(links), "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}}, "version": 0.4}  # fmt: skip


def ui_to_api(ui: dict, info: dict) -> dict:
    """Rebuild the API prompt from a UI workflow (widgets in ComfyUI's order, links by id)."""
    link_src = {lk[0]: [str(lk[1]), lk[2]] for lk in ui["links"]}
    api = {}
    for node in ui["nodes"]:
        cls, values = node["type"], list(node.get("widgets_values", []))
        linked = {i["name"]: link_src[i["link"]] for i in node.get("inputs", []) if i.get("link") is not None}
        inputs = {}
        for name, kind, opts in _spec(info, cls):
            if name in linked:
                inputs[name] = linked[name]
            elif kind in WIDGET_TYPES:
                inputs[name] = values.pop(0)
                if opts.get("control_after_generate"):
                    values.pop(0)
        api[str(node["id"])] = {"class_type": cls, "inputs": {k: v for k, v in inputs.items() if v is not None}}
    return api


def load_object_info(args) -> dict:
    if args.url:
        with urllib.request.urlopen(args.url.rstrip("/") + "/object_info", timeout=30) as r:
            return json.loads(r.read())
    with open(args.object_info) as f:
        return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--object-info", help="a saved /object_info JSON (ComfyUI with this pack loaded)")
    src.add_argument("--url", help="a running ComfyUI with this pack loaded")
    ap.add_argument("--out", default=os.path.join(ROOT, "workflows"))
    args = ap.parse_args(argv)
    info = load_object_info(args)
    os.makedirs(os.path.join(args.out, "api"), exist_ok=True)
    for name, graph in WORKFLOWS.items():
        api = to_api(graph)
        ui = to_ui(graph, info)
        if ui_to_api(ui, info) != {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in api.items()}:
            raise SystemExit(f"{name}: the UI form does not round-trip to the API form")
        with open(os.path.join(args.out, "api", name + ".json"), "w") as f:
            json.dump(api, f, indent=1)
            f.write("\n")
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump(ui, f, indent=1)
            f.write("\n")
        print(f"{name}: {len(api)} nodes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
