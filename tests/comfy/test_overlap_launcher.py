"""TP2_OVERLAP through the product path (issue 51): scripts/start-tp2.sh starts two CPU ranks with the row-parallel
reduce whole (TP2_OVERLAP=0), then in 3 overlapped chunks, by default and with --fast (the reduce-scatter in
sub-blocks of every rank's rows); tp2-submit queues the tiny demo workflow on rank 0 and checks every rank wrote the
same files. The chunks change when sums travel, not what is summed: both runs' files are the same bytes where a GEMM
rounds each row alike whatever rows share it, as the GPU kernels do. On CPU, comfy-kitchen's eager int8 path rotates
activations with a float GEMM, and some CPUs' BLAS rounds a GEMM of a few rows by its row count (seen on a 2-core AMD
EPYC with AVX-512: chunks of under ~20 rows): there the latents must agree to within int8 rounding (SQNR >= 30 dB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from comfy_harness import COMFYUI_DIR, ROOT, demo_workflow, have_comfyui, launch, stop_launched, tiny_base

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]
ENV = {"TP2_PROMPT_TIMEOUT_S": "60", "TP2_TIMEOUT_S": "120"}


def _files(launched, tmp_path, name: str) -> dict[str, tuple[str, str]]:
    """Queue the demo through tp2-submit: {rank 0's file name: (sha256, path)}, once it says every rank's files match."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(demo_workflow("overlap", steps=2)))
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "tp2-submit"), str(path), "--ports", ",".join(map(str, launched["ports"])),
           "--out", str(tmp_path / name), "--quiet", "--timeout", "240"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "identical" in res.stdout, res.stdout + res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if line.strip().startswith("rank 0:")]
    assert len(rows) == 3, res.stdout  # the WEBP and two latents
    return {os.path.basename(r[3]): (r[2], r[3]) for r in rows}


def _sqnr_db(a: str, b: str) -> float:
    from safetensors.torch import load_file

    x, y = (load_file(p)["latent_tensor"].double() for p in (a, b))
    return float(10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum().clamp_min(1e-300)))


@pytest.mark.parametrize("mode", ["default", "fast", "int8"])
def test_overlapped_reduce_writes_the_same_bytes(tmp_path, mode):
    """`int8`: the second run also sends its sums through TP2_WIRE=int8 (tp2/wire.py): every rank's files are still
    the same bytes (tp2-submit checks), and its latents are within the wire's rounding of the exact run's."""
    base, files = tiny_base(tmp_path), {}
    for overlap in ("0", "3"):
        env = dict(ENV, TP2_OVERLAP=overlap, **({"TP2_WIRE": "int8"} if mode == "int8" and overlap == "3" else {}))
        launched = launch(tmp_path / f"ranks{overlap}", base, env, args=("--fast",) if mode == "fast" else ())
        try:
            files[overlap] = _files(launched, tmp_path, f"overlap{overlap}")
            with open(os.path.join(launched["run_dir"], "rank1.log"), errors="replace") as f:
                said = "row-parallel reduce in 3 chunks" if overlap == "3" else "row-parallel reduce one collective per layer"
                log = f.read()
                assert said in log, f"rank 1 did not say '{said}'"
                assert f"wire {env.get('TP2_WIRE', 'exact')};" in log
        finally:
            assert stop_launched(launched).returncode == 0
    if files["0"] != files["3"]:  # a BLAS that rounds by row count (see above), or the int8 wire: the same sums within rounding
        assert files["0"].keys() == files["3"].keys(), files
        for name in (n for n in files["0"] if n.endswith(".latent")):
            db = _sqnr_db(files["0"][name][1], files["3"][name][1])
            assert db >= (25 if mode == "int8" else 30), f"{name}: the overlapped run's latent is {db:.1f} dB from the whole reduce's"
    assert mode != "int8" or files["0"] != files["3"]  # the wire ran
