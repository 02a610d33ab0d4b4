#!/usr/bin/env python3
"""Template-browser thumbnails for the bundled workflows: workflows/NAME.jpg next to workflows/NAME.json.

ComfyUI's template browser lists a custom node pack's workflows/*.json and asks for each card's picture at
/api/workflow_templates/<pack>/<NAME>.jpg (the frontend fixes the extension at .jpg for packs' templates).
Each picture is drawn from its workflow: the nodes where the canvas puts them, the links between them coloured
by type, and a title band with the workflow's name, size and that it runs on every rank.

    .venv/bin/python scripts/make_thumbnails.py [--check]     (--check: exit 1 if a picture is missing or stale)
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import sys

from PIL import Image, ImageDraw, ImageFont

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOWS = os.path.join(ROOT, "workflows")
SIZE = (400, 300)
BAND = 64  # the title band's height
LINK_COLOURS = {"MODEL": "#b39ddb", "CLIP": "#ffd500", "VAE": "#ff6e6e", "CONDITIONING": "#ffa931", "LATENT": "#ff9cf9",
                "IMAGE": "#64b5f6", "AUDIO": "#77dd77", "VIDEO": "#4dd0e1"}  # fmt: skip


def _font(size: int):
    return ImageFont.load_default(size=size)


def _caption(workflow: dict) -> str:
    """'832x480, 124 frames' from the first three whole numbers of the H3 latent node's widgets, when there is one."""
    for node in workflow["nodes"]:
        if node["type"].startswith(("EmptyMiniMaxH3", "MiniMaxH3")):
            ints = [v for v in node.get("widgets_values", []) if isinstance(v, int) and not isinstance(v, bool)]
            if len(ints) >= 3:
                return f"{ints[0]}x{ints[1]}, {ints[2]} frames"
    return ""


def draw(workflow: dict, name: str) -> Image.Image:
    img = Image.new("RGB", SIZE, "#1e1e1e")
    d = ImageDraw.Draw(img)
    nodes = {n["id"]: n for n in workflow["nodes"]}
    x0 = min(n["pos"][0] for n in nodes.values())
    y0 = min(n["pos"][1] for n in nodes.values())
    x1 = max(n["pos"][0] + n.get("size", [200, 100])[0] for n in nodes.values())
    y1 = max(n["pos"][1] + n.get("size", [200, 100])[1] for n in nodes.values())
    pad = 14
    scale = min((SIZE[0] - 2 * pad) / (x1 - x0), (SIZE[1] - BAND - 2 * pad) / (y1 - y0))

    def box(n):
        (x, y), (w, h) = n["pos"], n.get("size", [200, 100])
        left, top = pad + (x - x0) * scale, BAND + pad + (y - y0) * scale
        return left, top, left + w * scale, top + h * scale

    for _, src, _, dst, _, kind in workflow["links"]:
        a, b = box(nodes[src]), box(nodes[dst])
        d.line([(a[2], (a[1] + a[3]) / 2), (b[0], (b[1] + b[3]) / 2)], fill=LINK_COLOURS.get(kind, "#9e9e9e"), width=2)
    small = _font(10)
    for n in nodes.values():
        left, top, right, bottom = box(n)
        d.rounded_rectangle((left, top, right, bottom), radius=4, fill="#353535", outline="#4a4a4a")
        d.rectangle((left, top, right, top + 13), fill="#2a4a6a" if n["type"].startswith(("MiniMax", "EmptyMiniMax")) else "#444")
        label = n.get("title") or n["type"]
        while label and d.textlength(label, font=small) > right - left - 6:
            label = label[:-1]
        d.text((left + 3, top + 1), label, fill="#eeeeee", font=small)
    d.rectangle((0, 0, SIZE[0], BAND), fill="#123524")
    d.text((10, 6), name, fill="#ffffff", font=_font(17))
    caption = ", ".join(x for x in (_caption(workflow), "MiniMax-H3, tensor parallel: every rank runs it") if x)
    d.text((10, 32), caption, fill="#b9f6ca", font=_font(12))
    return img


def jpeg(img: Image.Image) -> bytes:
    out = io.BytesIO()
    img.save(out, "JPEG", quality=85, optimize=True)
    return out.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a picture is missing or differs")
    args = ap.parse_args(argv)
    stale = []
    for path in sorted(glob.glob(os.path.join(WORKFLOWS, "*.json"))):
        name = os.path.splitext(os.path.basename(path))[0]
        with open(path) as f:
            blob = jpeg(draw(json.load(f), name))
        target = os.path.join(WORKFLOWS, name + ".jpg")
        if args.check:
            if not os.path.exists(target) or open(target, "rb").read() != blob:
                stale.append(target)
            continue
        with open(target, "wb") as f:
            f.write(blob)
        print(f"{target}: {len(blob)} bytes")
    if stale:
        print("missing or stale (run scripts/make_thumbnails.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
