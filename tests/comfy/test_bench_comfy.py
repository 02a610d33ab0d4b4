"""The sampler benchmark (scripts/bench/bench_comfy.py) against real servers on CPU, so a device run does not find
its bugs: the pack at tp_size 1 and TP2 in the one-GPU mode's layout (every rank on "GPU 0", gloo) with the tiny
checkpoint. Checks what the benchmark reports, not its timings: every prompt succeeded, the ranks computed the same
latents (the digests they logged before the pack made the files alike), each row carries per-process peaks and the pack's log lines, and the table was written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from comfy_harness import COMFYUI_DIR, ROOT, have_comfyui

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

SCRIPTS = os.path.join(ROOT, "scripts")


def _bench(tmp_path, *options: str) -> tuple[subprocess.CompletedProcess, str]:
    """bench_comfy.py with `options` on the tiny int8 checkpoint, the CPU for every rank: (the run, its --out)."""
    base, out, fe = tmp_path / "base", tmp_path / "out", tmp_path / "fe"
    for d in ("custom_nodes", "models/diffusion_models", "models/h3_conditioning"):
        (base / d).mkdir(parents=True)
    os.symlink(ROOT, base / "custom_nodes" / "minimax-h3-tp2")
    fe.mkdir()
    (fe / "index.html").write_text("<html></html>")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TP2_", "MASTER_"))}
    make = [sys.executable, os.path.join(SCRIPTS, "make_tiny_h3.py")]
    subprocess.run([*make, str(base / "models/diffusion_models/tiny.safetensors"), "--int8", "--hidden", "512", "--heads", "4", "--ffn", "1024", "--text-dim", "256"], check=True, env=env)  # fmt: skip
    subprocess.run(
        [*make, "--conditioning", str(base / "models/h3_conditioning/cond.safetensors"), "--text-dim", "256"], check=True, env=env
    )
    cmd = [sys.executable, os.path.join(SCRIPTS, "bench", "bench_comfy.py"), "--comfyui", COMFYUI_DIR, "--base", str(base),
           "--front-end", str(fe), "--out", str(out), "--ckpt", "tiny.safetensors", "--cond", "cond.safetensors",
           "--resolutions", "64x64", "--frames", "5", "--steps", "2", "--attn", "sdpa", "--comfy-args=--cpu", *options]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env), out


def test_bench_comfy_runs_the_pack_at_tp1_and_tp2_on_one_device(tmp_path):
    options = ("--memory-resolutions", "64x64x22", "--memory-steps", "1", "--tp-sizes", "1:pack+bf16+fnorm+easycache,2:bf16+sp+fnorm", "--one-gpu")
    run, out = _bench(tmp_path, *options)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.load(open(out / "bench.json"))
    assert [(r["tp_size"], r["resolution"], r["memory_only"]) for r in rows] == [
        (1, "64x64", False),
        (2, "64x64", False),
        (2, "64x64x22", True),
    ]
    for r in rows:
        assert "error" not in r and r["identical"], r
        assert len(r["process_peak_mib"]) == len(r["pack_log"]) == r["tp_size"], r  # one entry per server (no GPU: None)
    assert rows[0]["variant"] == "pack+bf16+fnorm+easycache"  # ComfyUI ran its EasyCache node in that row's graph
    assert rows[0]["s_per_step"] > 0 and rows[1]["s_per_step"] > 0
    assert rows[0]["s_per_step_progress"] > 0  # the progress events' spacing, beside the span to the sampler's end
    assert "| 64x64x22 (memory) | 2 | bf16+sp+fnorm | 1 |" in run.stdout, run.stdout[-2000:]


def test_bench_comfy_emulates_the_link_for_rank_0_beside_a_hollow_peer(tmp_path):
    """Variant link1000-20000: rank 0's collectives over an emulated link of 20 ms a collective (and 1000 GB/s), rank 1
    hollow. Its log lines: NCCL's path with TP2_OVERLAP's 4 chunks (sequence parallelism's 2 blocks of 2 gathers of int8
    rows and scales and 2 reduce-scatters in 4 sub-blocks, the last gather, and the int8 vote at the first call), each
    collective 20 ms on the link; rank 1 never ran a block (no sequence-parallel layout logged)."""
    run, out = _bench(tmp_path, "--memory-resolutions", "", "--tp-sizes", "2:bf16+sp+link1000-20000")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (row,) = json.load(open(out / "bench.json"))
    assert "error" not in row and not row["identical"] and row["replaced"] >= 1, row  # rank 1 hollow: its latents differ, then replaced
    logs = [open(out / "run" / f"tp2bf16-sp-link1000-20000_rank{r}.log").read() for r in (0, 1)]
    calls = [line.split("issued ")[1] for line in logs[0].splitlines() if "this model call issued" in line]
    counts = [int(call.split()[0]) for call in calls]
    assert counts == [26, 25], calls
    assert all(abs(float(call.split(", ")[-1].split()[0]) - 20.0 * n) < 0.5 for call, n in zip(calls, counts)), calls
    assert "a hollow peer" in logs[1] and "sequence parallel: " in logs[0] and "sequence parallel: " not in logs[1]
