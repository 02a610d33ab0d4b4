"""The whole-video benchmark (scripts/bench/make_models.py + scripts/bench/whole_video.py) against real servers on
CPU, so a device run does not find its bugs: the tiny stand-ins under the bundled workflow's own file names, stock
TP1 and TP2 (gloo, with a ComfyUI flag added by `+FLAG`), cold then warm, on a host made smaller by the host ballast.
Checks what the benchmark reports, not its timings: every prompt succeeded, the ranks' MP4s are byte-identical, the
cold prompt loaded the four models and the warm one none, the warm prompt re-ran the encode and the sampler, the host
memory was read at every node's start, and the table was written. Then the device's set-up: the H3 files cut ahead into
the rank cache and freed on disk, and TP2 makes the same MP4 from the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from comfy_harness import COMFYUI_DIR, ROOT, have_comfyui
from safetensors import safe_open

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

BENCH = os.path.join(ROOT, "scripts", "bench")
MODELS = {"MiniMaxH3", "MiniMaxH3TEModel_", "MiniMaxH3VideoVAE", "MiniMaxH3AudioVAE"}


def test_the_whole_video_benchmark_runs_tp1_and_tp2_on_cpu(tmp_path):
    base, out, fe = tmp_path / "base", tmp_path / "out", tmp_path / "fe"
    fe.mkdir()
    (fe / "index.html").write_text("<html></html>")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TP2_", "MASTER_"))}
    subprocess.run([sys.executable, os.path.join(BENCH, "make_models.py"), "--comfyui", COMFYUI_DIR, "--models", str(base / "models"), "--tiny"],
                   check=True, timeout=600, env=env)  # fmt: skip
    with safe_open(str(base / "models" / "vae" / "minimax_h3_audio_vae_fp32.safetensors"), "pt") as f:  # no torch.empty leftovers
        assert f.get_tensor("latents_std").eq(1).all() and f.get_tensor("latents_mean").eq(0).all()
    cmd = [sys.executable, os.path.join(BENCH, "whole_video.py"), "--comfyui", COMFYUI_DIR, "--base", str(base), "--front-end", str(fe),
           "--out", str(out), "--tiny", "--configs", "tp1,tp2+disable-pinned-memory", "--commit", "test",
           "--host-hold-gib", "0.5"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "host: held 0.5 GiB" in run.stdout, run.stdout[-3000:]  # the ballast held the host's memory but what was asked
    rows = [json.loads(line) for line in open(out / "whole_video.jsonl")]
    assert [(r["config"], r["prompt"]) for r in rows] == [
        ("tp1", "cold"),
        ("tp1", "warm"),
        ("tp2+disable-pinned-memory", "cold"),
        ("tp2+disable-pinned-memory", "warm"),
    ]
    for r in rows:
        assert all(x["ok"] for x in r["results"]), r
        assert r["ranks_identical"] and all(x["mp4_bytes"] > 1000 for x in r["results"]), r
        assert r["environment"]["commit"] == "test" and r["environment"]["torch"]
        for x in r["results"]:
            assert x["whole prompt"] > 0 and x["sampling"] > 0 and x["text encode"] > 0 and x["s/step"] > 0, x
            assert set(x["loaded"]) == (MODELS if r["prompt"] == "cold" else set()), x["loaded"]
            assert x["host_peak_rss_gib"] > 0.1 and x["host_peak_anon_gib"] > 0.1, x
            assert isinstance(x["gpu_peak_gib_by_phase"], dict) and isinstance(x["pack_log"], list), x  # no GPU: empty
            assert x["host_anon_gib_by_phase"]["sampling"] > 0.1, x
            at = {h["before"]: h for h in x["host_at_node_start"]}
            assert {"KSampler", "VAEDecode", "end"} <= set(at) and at["end"]["RssAnon"] > 0.1 and at["end"]["pinned"] == 0, at
    assert len(rows[2]["results"]) == 2 and rows[0]["results"][0]["mp4_sha256"] != rows[1]["results"][0]["mp4_sha256"]
    table = (out / "whole_video_table.md").read_text()
    assert "| tp2+disable-pinned-memory | warm |" in table and "x)" in table  # the TP2 rows carry their ratio to stock TP1

    # the device's set-up (make_models.py --cut-ahead 2): each rank's cut in the rank cache, the H3 files then freed on
    # disk; the ranks load through the cache and never read a freed byte (zeros would change the video)
    env["TP2_CACHE_DIR"] = str(tmp_path / "cache")
    dit = base / "models" / "diffusion_models" / "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
    blocks = os.stat(dit).st_blocks
    subprocess.run([sys.executable, os.path.join(BENCH, "make_models.py"), "--comfyui", COMFYUI_DIR, "--models", str(base / "models"), "--tiny",
                    "--cut-ahead", "2", "--punch-min-bytes", "4096"], check=True, timeout=600, env=env)  # fmt: skip
    assert len(list((tmp_path / "cache" / "rank_cache").glob("*.tp2-rank[01].safetensors"))) == 4  # DiT and encoder, two ranks
    assert os.stat(dit).st_blocks < blocks / 2 and (dit.parent / (dit.name + ".punched")).exists()
    cmd[cmd.index("--out") + 1] = str(tmp_path / "out_cut")
    cmd[cmd.index("--configs") + 1] = "tp2+disable-pinned-memory"  # the same name: the MP4 records the workflow
    run = subprocess.run([*cmd[:-2], "--prompts", "cold"], capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (cut,) = [json.loads(line) for line in open(tmp_path / "out_cut" / "whole_video.jsonl")]
    assert {x["mp4_sha256"] for x in cut["results"]} == {rows[2]["results"][0]["mp4_sha256"]}, (cut, rows[2])
    logs = [open(x).read() for x in (tmp_path / "out_cut" / "run").glob("tp2_*rank*/comfyui.log")]
    assert len(logs) == 2 and all(log.count("(rank cache ") == 2 for log in logs)  # the DiT and the encoder, each rank
