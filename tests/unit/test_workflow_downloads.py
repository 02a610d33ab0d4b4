"""The bundled UI workflows carry their model files' download addresses as ComfyUI's own H3 templates do (the
`models` property of a loader node, which ComfyUI's missing-models dialog offers): the same address and folder
for every release file the templates of the pip package comfyui-workflow-templates name."""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _official_models() -> dict[str, dict]:
    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    if spec is None:
        pytest.skip("the pip package comfyui-workflow-templates (ComfyUI's requirements) is not installed")
    found = {}

    def walk(value) -> None:  # the templates keep their nodes in subgraphs too
        if isinstance(value, dict):
            for m in value.get("properties", {}).get("models", []) if isinstance(value.get("properties"), dict) else []:
                found[m["name"]] = m
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for path in glob.glob(os.path.join(os.path.dirname(spec.origin), "templates", "video_minimax_h3_*.json")):
        walk(json.load(open(path)))
    return found


def test_every_loader_of_a_release_file_carries_the_official_download_address():
    official = _official_models()
    assert len(official) >= 4, sorted(official)
    checked = 0
    for path in sorted(glob.glob(os.path.join(ROOT, "workflows", "*.json"))):
        for node in json.load(open(path))["nodes"]:
            names = [v for v in node.get("widgets_values", []) if isinstance(v, str) and v.endswith(".safetensors")]
            release = [n for n in names if n in official]
            models = node.get("properties", {}).get("models", [])
            assert [m["name"] for m in models] == release, (path, node["type"], names, models)
            for m in models:
                assert m == official[m["name"]], (path, m, official[m["name"]])
                checked += 1
    assert checked == 20, checked  # 5 bundled H3 workflows x 4 files (the tiny demo names none)
