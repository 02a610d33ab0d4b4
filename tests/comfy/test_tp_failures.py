"""Failures on real ComfyUI servers: a rank killed mid-sampling, its restart, node caches that diverged because
of it, and checkpoints that must be refused (rank files of another tp_size or plan). Each refusal comes within
60 s and leaves the servers usable for the next prompt."""

from __future__ import annotations

import os
import time

import pytest
from comfy_harness import (
    COMFYUI_DIR,
    Server,
    assert_success,
    cleanup,
    error_message,
    have_comfyui,
    new_id,
    run_prompt,
    start_ranks,
    tiny_workflow,
)
from conftest import make_checkpoint, make_tiny_h3

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

TP_ENV = {"TP2_PROMPT_TIMEOUT_S": "10", "TP2_TIMEOUT_S": "30"}
COND, FLOAT = "h3_tiny_cond.safetensors", "h3_tiny_float.safetensors"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("fail_models")
    make_checkpoint(str(d / FLOAT))
    make_tiny_h3.main(["--conditioning", str(d / COND)])
    models = {f"diffusion_models/{FLOAT}": str(d / FLOAT), f"h3_conditioning/{COND}": str(d / COND)}
    from tp2.rank_cache import cut_ahead

    cut = cut_ahead(str(d / FLOAT), 2, 1, str(d / "cache"))  # rank 1's cut, selected as if it were a checkpoint
    models["diffusion_models/h3_tiny_float.rank1_cut.safetensors"] = cut
    root = str(tmp_path_factory.mktemp("fail_world"))
    servers = start_ranks(root, 2, models, TP_ENV, front_door=False)  # the dual-submission mode
    yield servers, models
    for s in servers:
        s.stop()
    cleanup(root)


def test_a_rank_cache_file_selected_as_a_checkpoint_is_refused_then_next_prompt_works(world):
    servers, _ = world
    t0 = time.monotonic()
    hs = run_prompt(servers, tiny_workflow("h3_tiny_float.rank1_cut.safetensors", COND, prefix="wrongfile"), 60)
    assert time.monotonic() - t0 < 60
    for h in hs:
        msg = error_message(h)
        assert h["status"]["status_str"] == "error" and "is already a tensor-parallel shard (rank 1 of 2)" in msg, msg
    assert_success(servers, run_prompt(servers, tiny_workflow(FLOAT, COND, prefix="after_wrongfile")))


def test_status_node_reports_the_rank(world):
    servers, _ = world
    wf = {"1": {"class_type": "TP2Status", "inputs": {}}}
    hs = run_prompt(servers, wf)
    assert_success(servers, hs)
    for r, h in enumerate(hs):
        (text,) = h["outputs"]["1"]["text"]
        assert f"rank {r} of tp_size 2" in text and "process group: generation" in text, text


def test_rank_killed_mid_sampling_then_restart_and_cache_recovery(world):
    servers, models = world
    short = tiny_workflow(FLOAT, COND, prefix="short")
    assert_success(servers, run_prompt(servers, short))  # cached on both ranks now

    pid = new_id()
    long_wf = tiny_workflow(FLOAT, COND, steps=400, prefix="long")
    for s in servers:
        s.submit(long_wf, pid)
    time.sleep(4)
    servers[1].kill()
    t0 = time.monotonic()
    h0 = servers[0].wait_history(pid, 60)
    msg = error_message(h0)
    assert h0["status"]["status_str"] == "error" and "PeerLostError" in msg and "rank 1 ended: it closed its connection" in msg, msg
    assert time.monotonic() - t0 < 60

    env = {"TP2_RANK": "1", "TP2_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _master_port(servers[1])}
    servers[1] = Server(servers[1].base, models, TP_ENV | env)
    servers[1].wait_ready()
    # rank 0 still holds the short prompt's sampler output in its node cache, the restarted rank 1 does not:
    # the pack must not deadlock on that; it clears caches after the failure, so both ranks run it again
    hs = run_prompt(servers, short)
    assert_success(servers, hs)
    outs = []
    for s, h in zip(servers, hs):
        files = {}
        for node in h["outputs"].values():
            for item in node.get("latents", []):
                with open(os.path.join(s.base, "output", item["subfolder"], item["filename"]), "rb") as f:
                    files[item["filename"].split("_0")[0]] = f.read()
        outs.append(files)
    assert outs[0] == outs[1] and len(outs[0]) == 2
    log0 = servers[0].tail(300)
    assert "process group generation 2 formed" in log0
    assert "clearing this rank's node cache" in log0


def _master_port(server: Server) -> str:
    with open(server.log_path, "rb") as f:
        log = f.read().decode(errors="replace")
    i = log.index("MASTER 127.0.0.1:")
    return log[i + len("MASTER 127.0.0.1:") :].split(",")[0]
