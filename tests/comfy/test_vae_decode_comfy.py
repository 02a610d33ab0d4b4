"""Parallel H3 video VAE decode on real ComfyUI servers (CPU, gloo): LoadLatent -> VAEDecode -> SaveImage on TP2
ranks and on one plain server (pack linked, no TP env); every PNG byte-identical across the three.

The VAE is NOT the real one: the real H3 video VAE is 2.6 B parameters with widths hard-coded in ComfyUI's class,
too big for a 2-CPU test machine. A test-only custom node (tests/comfy/fixtures/h3_small_vae, linked into these
servers only, active only with H3_TEST_SMALL_VAE=1) makes ComfyUI build its own `MiniMaxH3VideoVAE` class at a
small width, and the checkpoint has random weights with the real key names, so ComfyUI detects, loads and runs it
as the H3 VAE through its normal VAELoader / VAEDecode path.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from comfy_harness import (
    COMFYUI_DIR,
    ROOT,
    Server,
    assert_success,
    have_comfyui,
    new_id,
    output_files,
    start_tp,
    stop_at_teardown,
    submit_once,
)
from safetensors.torch import save_file

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

FIXTURE_DIR = os.path.join(ROOT, "tests", "comfy", "fixtures")
SMALL_VAE = {"H3_TEST_SMALL_VAE": "1"}
TP_ENV = {"TP2_PROMPT_TIMEOUT_S": "20", "TP2_TIMEOUT_S": "30", **SMALL_VAE}
VAE = "h3_small_video_vae.safetensors"


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("vae"))
    vae_path = os.path.join(root, VAE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TP2_", "MASTER_"))}
    env.update(SMALL_VAE, PYTHONPATH=os.pathsep.join([COMFYUI_DIR, FIXTURE_DIR]))
    code = f"import comfy.cli_args as a; a.args.cpu = True; import h3_small_vae as m; m.write_checkpoint({vae_path!r}, seed=0)"
    subprocess.run([sys.executable, "-c", code], cwd=COMFYUI_DIR, env=env, check=True, timeout=120)
    for name in ("rank0", "rank1", "plain"):
        os.makedirs(os.path.join(root, name, "custom_nodes"))
        os.symlink(os.path.join(FIXTURE_DIR, "h3_small_vae"), os.path.join(root, name, "custom_nodes", "h3_small_vae"))
    models = {f"vae/{VAE}": vae_path}
    plain = Server(os.path.join(root, "plain"), models, SMALL_VAE)  # starts now, alongside the ranks
    out = [*start_tp(root, 2, models, TP_ENV), plain]
    plain.wait_ready()
    for s in out:
        for t in (7, 17):
            latent = torch.randn(1, 24, t, 4, 4, generator=torch.Generator().manual_seed(t))
            save_file(
                {"latent_tensor": latent, "latent_format_version_0": torch.tensor([])}, os.path.join(s.base, "input", f"h3_t{t}.latent")
            )

    return stop_at_teardown(request, out, root)


def decode_workflow(latent: str, prefix: str) -> dict:
    return {
        "1": {"class_type": "LoadLatent", "inputs": {"latent": latent}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["1", 0], "vae": ["2", 0]}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": prefix}},
    }


def decode_everywhere(servers, latent: str, prefix: str) -> list[dict[str, bytes]]:
    pid = new_id()  # the same prompt on the two ranks and the plain server
    submit_once(servers, decode_workflow(latent, prefix), pid)
    histories = [s.wait_history(pid, 120) for s in servers]
    assert_success(servers, histories)
    return [output_files(s, h) for s, h in zip(servers, histories)]


def log_text(server: Server) -> str:
    with open(server.log_path, errors="replace") as f:
        return f.read()


@pytest.mark.parametrize(
    "t, frames, line",
    [
        (17, 56, "VAE decode split over 2 ranks: 3 chunks, 3 tiles (rank 0: 2; rank 1: 1)"),  # one tile per chunk: rank 0 decodes two
        (7, 22, "VAE decode: latent of 7 frames is one chunk, nothing to split: decoding on this rank alone"),
    ],
)
def test_tp2_decode_pngs_identical_to_one_server(servers, t, frames, line):
    rank0, rank1, one = decode_everywhere(servers, f"h3_t{t}.latent", f"vae_t{t}")
    assert len(rank0) == frames, sorted(rank0)
    assert len(set(rank0.values())) > frames // 2, "decoded frames are alike: the test could not see a misplaced chunk"
    assert rank0 == rank1, "the ranks wrote different PNGs"
    assert rank0 == one, "TP2 PNGs differ from the plain server's"
    for s in servers[:2]:
        assert line in log_text(s), s.tail()
    assert "VAE decode" not in log_text(servers[2]), "the plain server (no TP env) went through the pack"
