"""Uneven shares (--split), the way users run them: two ranks through scripts/start-tp2.sh and rank 0's front door
at 3:1, four ranks at 5:1:1:1 (started as the launcher starts them). Ranks write the same bytes; TP against one
server holds the even split's tolerances (float: relative 1e-4; int8 ConvRot: SQNR >= 25 dB); each rank builds its
own widths; a split the models cannot take is refused before any rank starts; --split auto measures and decides.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from comfy_harness import (
    COMFYUI_DIR,
    ROOT,
    assert_success,
    call,
    demo_workflow,
    error_text,
    free_port,
    have_comfyui,
    launch,
    output_files,
    run_prompt,
    servers_for,
    stop_launched,
    tiny_base,
    tiny_workflow,
    wait_done,
)
from conftest import TINY_COND, make_checkpoint
from safetensors.torch import load
from slowed_balance import slowed_python

from tp2.numerics import sqnr_db

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

TP_ENV = {"TP2_PROMPT_TIMEOUT_S": "20", "TP2_TIMEOUT_S": "60"}
INT8 = "h3_tiny_int8.safetensors"  # tiny_base's: 4 heads = 2 ConvRot pairs, FFN 512 = 2 groups: only 1:1 cuts it
WIDE_INT8, WIDE_FLOAT = "h3_tiny_int8_wide.safetensors", "h3_tiny_float_wide.safetensors"  # 16 heads, FFN 2048
FULL = "h3_tiny_full_adaln.safetensors"  # float, 4 heads, the full form's adaln split along its input too
CHECKPOINTS = {
    WIDE_INT8: ("--int8", "--heads", "16", "--ffn", "2048"),
    WIDE_FLOAT: ("--heads", "16", "--ffn", "2048"),
    FULL: ("--adaln", "full"),
}
# each checkpoint's widths at 3:1 and at 5:1:1:1, as the plan summary in every rank's log says them
WIDTHS_3_1 = {
    WIDE_INT8: "heads 16->12+4, ffn 2048->1536+512",
    WIDE_FLOAT: "heads 16->12+4, ffn 2048->1536+512",
    FULL: "heads 4->3+1, ffn 512->384+128",
}
WIDTHS_5_1_1_1 = "heads 16->10+2+2+2, ffn 2048->1280+256+256+256"
LORA = "h3_tiny_float_wide_lora.safetensors"  # scripts/make_tiny_lora.py: qkv, out_proj, fc1, fc2, adaln, refiner


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A --base-directory with the pack, tiny_base's int8 model and conditioning, and the wider models."""
    base = tiny_base(tmp_path_factory.mktemp("uneven"))
    for name, args in CHECKPOINTS.items():
        make_checkpoint(os.path.join(base, "models", "diffusion_models", name), *args)
    os.makedirs(os.path.join(base, "models", "loras"))
    lora = [sys.executable, os.path.join(ROOT, "scripts", "make_tiny_lora.py"), "--refiner"]
    subprocess.run(
        [*lora, os.path.join(base, "models", "diffusion_models", WIDE_FLOAT), os.path.join(base, "models", "loras", LORA)], check=True
    )
    return base


def _models(base: str) -> dict[str, str]:
    folders = ("diffusion_models", "h3_conditioning", "loras", "vae")
    return {f"{d}/{n}": os.path.join(base, "models", d, n) for d in folders for n in os.listdir(os.path.join(base, "models", d))}


@pytest.fixture(scope="module")
def plain(request, tmp_path_factory, base):
    return servers_for(request, tmp_path_factory, _models(base), "plain")[0]


@pytest.fixture(scope="module")
def launched(tmp_path_factory, base):
    launched = launch(tmp_path_factory.mktemp("split31"), base, TP_ENV, ("--split", "3:1"))
    yield launched
    stop_launched(launched)


def latents(files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    return {kind: load(blob)["latent_tensor"] for name, blob in files.items() for kind in ("video", "audio") if f"_{kind}_" in name}


def assert_matches_one_server(tp: dict[str, bytes], ref: dict[str, bytes], int8: bool) -> None:
    got, want = latents(tp), latents(ref)
    assert got.keys() == want.keys() == {"video", "audio"}
    for kind, a in got.items():
        b = want[kind]
        print(f"{kind}: rel {float((a - b).abs().max() / b.abs().max()):.2e}, SQNR {sqnr_db(a, b):.1f} dB")
        assert a.shape == b.shape and torch.isfinite(a).all()
        assert sqnr_db(a, b) >= 25.0 if int8 else float((a - b).abs().max() / b.abs().max()) < 1e-4, kind


def rank_outputs(run_dir: str, rank: int, prefix: str) -> dict[str, bytes]:
    d = os.path.join(run_dir, f"rank{rank}", "output", "latents")
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d)) if n.startswith(prefix + "_")}


def bundled_workflow(unet: str, prefix: str) -> dict:
    """The bundled tiny workflow (workflows/api/h3_tp2_tiny_demo.json) on `unet` (its own tiny model splits only 1:1)."""
    wf = demo_workflow(prefix, steps=2)
    next(n for n in wf.values() if n["class_type"] == "UNETLoader")["inputs"]["unet_name"] = unet
    return wf


def queue_on_rank0(launched, plain, wf: dict, prefix: str, int8: bool) -> dict[str, bytes]:
    """`wf` queued once on rank 0: every rank's bytes equal, and one server's result within the even split's tolerance."""
    status, body = call(launched["urls"][0], "/prompt", {"prompt": wf})
    assert status == 200, body
    for url in launched["urls"]:
        h = wait_done(url, body["prompt_id"], timeout=300)
        assert h["status"]["status_str"] == "success", (url, error_text(h))
    files = [rank_outputs(launched["run_dir"], r, prefix) for r in (0, 1)]
    assert len(files[0]) == 2 and files[0] == files[1], "the ranks wrote different bytes"
    histories = run_prompt([plain], wf, 300)
    assert_success([plain], histories)
    assert_matches_one_server(files[0], output_files(plain, histories[0]), int8)
    return files[0]


@pytest.mark.parametrize("unet", list(WIDTHS_3_1))
def test_launcher_split_3_1_same_bytes_and_one_servers_result(launched, plain, unet):
    queue_on_rank0(launched, plain, bundled_workflow(unet, f"split31_{unet[:-12]}"), f"split31_{unet[:-12]}", unet == WIDE_INT8)
    for r in (0, 1):
        log = open(os.path.join(launched["run_dir"], f"rank{r}.log")).read()
        assert "split 3:1: " in log and WIDTHS_3_1[unet] in log, f"rank {r} did not build the 3:1 widths"


def test_a_lora_at_3_1_is_sliced_by_the_shares(launched, plain):
    wf = bundled_workflow(WIDE_FLOAT, "split31_lora")
    loader = next(k for k, n in wf.items() if n["class_type"] == "UNETLoader")
    wf["99"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": [loader, 0], "lora_name": LORA, "strength_model": 1.0}}
    next(n for n in wf.values() if n["class_type"] == "KSampler")["inputs"]["model"] = ["99", 0]
    with_lora = latents(queue_on_rank0(launched, plain, wf, "split31_lora", int8=False))["video"]
    off = run_prompt([plain], bundled_workflow(WIDE_FLOAT, "split31_lora_off"), 300)
    without = latents(output_files(plain, off[0]))["video"]
    assert float((with_lora - without).abs().max() / without.abs().max()) > 0.05, "the LoRA changed nothing"


def test_sequence_parallel_at_3_1_gives_plain_3_1s_bytes(request, tmp_path_factory, base, launched):
    """TP2_SEQUENCE_PARALLEL=1 keeps an even row layout under uneven heads: the same latents as without it."""
    env = dict(TP_ENV, TP2_SPLIT="3:1", TP2_SEQUENCE_PARALLEL="1")
    ranks = servers_for(request, tmp_path_factory, _models(base), "split31_sp", 2, env)
    for unet in (WIDE_INT8, WIDE_FLOAT):
        prefix = f"split31sp_{unet[:-12]}"
        histories = run_prompt(ranks, bundled_workflow(unet, prefix), 300)
        assert_success(ranks, histories)
        sp = [output_files(s, h) for s, h in zip(ranks, histories)]
        assert sp[0] == sp[1], "the ranks wrote different bytes"
        status, body = call(launched["urls"][0], "/prompt", {"prompt": bundled_workflow(unet, prefix)})
        assert status == 200 and wait_done(launched["urls"][0], body["prompt_id"], timeout=300)["status"]["status_str"] == "success"
        wait_done(launched["urls"][1], body["prompt_id"], timeout=300)
        plain = latents(rank_outputs(launched["run_dir"], 0, prefix))
        assert all(torch.equal(t, plain[kind]) for kind, t in latents(sp[0]).items()), unet
    assert " sequence parallel: " in open(ranks[0].log_path).read(), "sequence parallelism did not run"


def test_status_and_panel_routes_show_the_split(launched):
    status, cluster = call(launched["urls"][0], "/tp2/cluster")
    assert status == 200 and cluster["split"].startswith("3:1 (rank 0 75%, rank 1 25%)"), cluster.get("split")
    assert all(r["status"]["split"] == cluster["split"] for r in cluster["ranks"])


def test_four_ranks_at_5_1_1_1(request, tmp_path_factory, base, plain):
    ranks = servers_for(request, tmp_path_factory, _models(base), "split5111", 4, dict(TP_ENV, TP2_SPLIT="5:1:1:1"))
    for unet in (WIDE_INT8, WIDE_FLOAT):
        wf = tiny_workflow(unet, TINY_COND, prefix=f"split5111_{unet[:-12]}")
        histories = run_prompt(ranks, wf, 300)
        assert_success(ranks, histories)
        files = [output_files(s, h) for s, h in zip(ranks, histories)]
        assert all(f == files[0] for f in files[1:]), "the ranks wrote different bytes"
        ref = run_prompt([plain], wf, 300)
        assert_matches_one_server(files[0], output_files(plain, ref[0]), unet == WIDE_INT8)
        assert all(WIDTHS_5_1_1_1 in open(s.log_path).read() for s in ranks)


def _start(tmp_path, base, port, *args, env=None) -> subprocess.CompletedProcess:
    cmd = [os.path.join(ROOT, "scripts", "start-tp2.sh"), "--comfyui", COMFYUI_DIR, "--tp-size", "2", "--cpu",
           "--run-dir", str(tmp_path / "ranks"), "--base-dir", base, "--base-port", str(port), *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, **(env or {})))


@pytest.mark.parametrize(
    "split,why",
    [("100:1", r"leaves|a rank would get none\. The nearest split that works is \d+:1"), ("3", r"not 2 positive whole numbers")],
)
def test_a_split_no_model_here_takes_is_refused_before_any_rank_starts(tmp_path, base, split, why):
    res = _start(tmp_path, base, free_port(), "--split", split)
    assert res.returncode != 0 and re.search(why, res.stderr), res.stdout + res.stderr
    # a model-dependent refusal says so; a malformed split is one line, refused before torch loads
    assert "refused before starting any rank" in res.stderr or res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "ranks" / "rank0.log").exists(), "a rank started"


def test_split_auto_gives_the_slower_rank_less(tmp_path, base):
    """Rank 1's timed block runs three times (tests/slowed_balance.py as $PYTHON): it measures about 3x slower, so it gets about
    a quarter; the measurements and the decision are printed and kept in RUN_DIR/split."""
    port = free_port()
    res = _start(tmp_path, base, port, "--split", "auto", env=dict(TP_ENV, PYTHON=slowed_python(tmp_path, "1,3")))
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        a, b = map(int, re.search(r"--split auto chose (\d+):(\d+)", res.stdout).groups())
        assert 2.0 <= a / b <= 4.5, (a, b)
        kept = (tmp_path / "ranks" / "split").read_text()
        assert "rank 0" in kept and "rank 1" in kept and f"{a}:{b}" in kept
        status, cluster = call(f"http://127.0.0.1:{port}", "/tp2/cluster")
        assert status == 200 and cluster["split"].startswith(f"{a}:{b}"), cluster
    finally:
        subprocess.run([os.path.join(ROOT, "scripts", "start-tp2.sh"), "stop", "--run-dir", str(tmp_path / "ranks")], timeout=60)


def test_what_is_shown_is_what_ran(tmp_path, base):
    """10:9 on the bundled tiny model (2 ConvRot pairs of heads) cuts it 1:1: /tp2/cluster and `status` say so beside
    the split asked for. A follower killed is restarted and shown healthy again with no prompt queued; `status` shows
    each restart with its reason, by hand too."""
    import signal
    import time

    launched = launch(tmp_path, base, TP_ENV, ("--split", "10:9"))
    launcher, run_dir = os.path.join(ROOT, "scripts", "start-tp2.sh"), launched["run_dir"]
    status_of = lambda: subprocess.run([launcher, "status", "--run-dir", run_dir], capture_output=True, text=True, timeout=60).stdout  # noqa: E731
    try:
        status, body = call(launched["urls"][0], "/prompt", {"prompt": bundled_workflow(INT8, "shown")})
        assert status == 200, body
        assert all(wait_done(u, body["prompt_id"], timeout=300)["status"]["status_str"] == "success" for u in launched["urls"])
        cut = f"{INT8} cut even (10:9 asked: too few units)"
        assert cut in call(launched["urls"][0], "/tp2/cluster")[1]["split"]
        assert f"split: 10:9 (rank 0 53%, rank 1 47%); {cut}" in status_of()
        pid = int(next(line.split()[1] for line in open(os.path.join(run_dir, "pids")) if line.startswith("1 ")))
        os.kill(pid, signal.SIGKILL)
        killed, healthy = time.monotonic(), None
        while time.monotonic() - killed < 120 and healthy is None:
            time.sleep(1)
            cluster = call(launched["urls"][0], "/tp2/cluster")[1]
            if cluster.get("healthy") == 2 and cluster["ranks"][1]["status"] and cluster["ranks"][1]["status"]["boot"]:
                healthy = time.monotonic() - killed
        print(f"\n[shown] rank 1 killed: both ranks healthy again after {healthy} s, no prompt queued")
        assert healthy is not None, cluster
        assert "1 restart(s); last: " in status_of() and "exited killed by signal 9 (KILL)" in status_of()
        subprocess.run([launcher, "restart", "--run-dir", run_dir, "--rank", "1"], capture_output=True, timeout=300, check=True)
        assert re.search(r"2 restart\(s\); last: \S+ \S+ rank 1 restarted by hand", status_of())
    finally:
        stop_launched(launched)


def test_a_plain_comfyui_with_the_pack_says_tp_is_off_and_how_to_start_it(plain):
    log = open(plain.log_path, errors="replace").read()
    assert log.count("minimax-h3-tp2: tensor parallelism is off in this ComfyUI (not started as a rank)") == 1, log[-2000:]
    assert "scripts/start-tp2.sh" in log
