#!/usr/bin/env python3
"""Plot s/step TP1 vs TP2 by resolution from a bench.json written by bench_comfy.py.

python scripts/bench/plot.py docs/bench/<run>.json docs/bench/<run>.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    rows = [r for r in json.load(open(src)) if "error" not in r and r.get("s_per_step")]
    fig, ax = plt.subplots(figsize=(7, 4))
    configs = []  # (tp_size, variant) in the order they ran; one line each
    for r in rows:
        if (r["tp_size"], r.get("variant", "-")) not in configs:
            configs.append((r["tp_size"], r.get("variant", "-")))
    for tp, variant in configs:
        pts = [(r["resolution"], r["s_per_step"]) for r in rows if (r["tp_size"], r.get("variant", "-")) == (tp, variant)]
        label = f"TP{tp}" + (f" {variant}" if variant not in ("-", "") else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker={1: "o", 2: "s"}.get(tp, "^"), label=label)
        for x, y in pts:
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_ylabel("s / step (median, 124 frames, cfg 1)")
    ax.set_xlabel("resolution (memory runs: TP2 only, 2 steps)")
    ax.set_title("MiniMax-H3 int8 ConvRot, real ComfyUI 0.33, H200")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
