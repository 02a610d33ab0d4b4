"""Parallel H3 video VAE decode on real ComfyUI servers (CPU, gloo): LoadLatent -> VAEDecode -> SaveImage on TP2
ranks and on one plain server (pack linked, no TP env); every PNG byte-identical across the three.

The VAE is NOT the real one: the real H3 video VAE is 2.6 B parameters with widths hard-coded in ComfyUI's class,
too big for a 2-CPU test machine. A test-only custom node (tests/comfy/fixtures/h3_small_vae, linked into these
servers only, active only with H3_TEST_SMALL_VAE=1) makes ComfyUI build its own `MiniMaxH3VideoVAE` class at a
small width, and the checkpoint has random weights with the real key names, so ComfyUI detects, loads and runs it
as the H3 VAE through its normal VAELoader / VAEDecode path. Faults are injected through TP2_TEST_FAULT_FILE (fixtures/tp2_seams).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from comfy_harness import (
    COMFYUI_DIR,
    ROOT,
    Server,
    assert_success,
    error_message,
    have_comfyui,
    new_id,
    output_files,
    start_ranks,
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
    out = [*start_ranks(root, 2, models, dict(TP_ENV, TP2_TEST_FAULT_FILE=os.path.join(root, "fault"))), plain]
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


def test_a_rank_stuck_in_the_split_decode_is_named_within_the_progress_timeout(servers):
    """Rank 1 hangs in its first tile decode, alive (its heartbeat goes on): rank 0, waiting for that tile, names it
    once it has waited the progress timeout (tp2/progress.py: here its floor, the tiles take well under a second), not
    after TP2_TIMEOUT_S (30 s here); both ranks fail with that reason, and the next decode is identical on both."""
    from tp2.progress import STUCK_FLOOR_S

    ranks = servers[:2]
    fault = os.path.join(os.path.dirname(ranks[0].base), "fault")
    with open(fault, "w") as f:
        f.write("1:tile:hang")
    pid = new_id()
    submit_once(ranks, decode_workflow("h3_t17.latent", "stuck"), pid)
    deadline = time.monotonic() + 60
    while os.path.exists(fault) and time.monotonic() < deadline:  # gone: rank 1 is in its tile decode, stuck
        time.sleep(0.05)
    t0 = time.monotonic()
    histories = [s.wait_history(pid, 60) for s in ranks]
    named = time.monotonic() - t0
    for r, h in enumerate(histories):
        message = error_message(h)
        assert h["status"]["status_str"] == "error" and "rank 1 is stuck in vae-decode" in message, (r, message)
        assert "it is alive (its heartbeat goes on)" in message, (r, message)
    assert named < STUCK_FLOOR_S + 5, named
    print(f"rank 1 named as stuck {named:.1f} s after it hung (progress timeout {STUCK_FLOOR_S:.0f} s)")
    rank0, rank1 = decode_everywhere(ranks, "h3_t17.latent", "after_stuck")
    assert rank0 == rank1 and len(rank0) == 56
