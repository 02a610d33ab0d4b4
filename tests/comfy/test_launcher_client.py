"""The product path on real ComfyUI: scripts/start-tp2.sh starts two CPU ranks, scripts/tp2-submit drives them,
`stop` leaves nothing behind; the bundled workflows are valid against the live /object_info (with the pack
loaded) and their UI and API forms agree; the demo command runs end to end."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from comfy_harness import COMFYUI_DIR, ROOT, free_port, have_comfyui, launch, stop_launched, tiny_base

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

SCRIPTS = os.path.join(ROOT, "scripts")
TINY = os.path.join(ROOT, "workflows", "api", "h3_tp2_tiny_demo.json")
API_FILES = sorted(glob.glob(os.path.join(ROOT, "workflows", "api", "*.json")))


def _load_make_workflows():
    spec = importlib.util.spec_from_file_location("make_workflows", os.path.join(SCRIPTS, "make_workflows.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_workflows = _load_make_workflows()


def _placeholders(base: str) -> None:
    """Every file the bundled workflows name, so ComfyUI's file combos list them (content is never loaded)."""
    from PIL import Image

    for folder, name in (
        ("diffusion_models", make_workflows.DIT),
        ("text_encoders", make_workflows.TEXT_ENCODER),
        ("vae", make_workflows.VIDEO_VAE),
        ("vae", make_workflows.AUDIO_VAE),
    ):
        os.makedirs(os.path.join(base, "models", folder), exist_ok=True)
        open(os.path.join(base, "models", folder, name), "wb").close()
    os.makedirs(os.path.join(base, "input"), exist_ok=True)
    for name in ("h3_first_frame.png", "h3_last_frame.png"):
        Image.new("RGB", (64, 64), (120, 80, 40)).save(os.path.join(base, "input", name))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    run = tmp_path_factory.mktemp("launcher")
    base = tiny_base(run)
    _placeholders(base)
    launched = launch(run, base, {"TP2_PROMPT_TIMEOUT_S": "15", "TP2_TIMEOUT_S": "20"})
    assert "rank 0: http://127.0.0.1:" in launched["stdout"] and "settings: TP2_INT8_KERNEL=auto" in launched["stdout"]
    yield dict(launched, run=run)
    stop = stop_launched(launched)
    assert stop.returncode == 0, stop.stderr


def submit(ranks, *args, timeout=180):
    cmd = [sys.executable, os.path.join(SCRIPTS, "tp2-submit"), *args, "--ports", ",".join(map(str, ranks["ports"])), "--quiet"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _hashes(stdout: str) -> list[str]:
    return [line.split()[2] for line in stdout.splitlines() if line.strip().startswith("rank ") and ":" in line]


def test_submit_tiny_workflow_identical_hashes(ranks, tmp_path):
    res = submit(ranks, TINY, "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("identical") == 2
    hashes = _hashes(res.stdout)
    assert len(hashes) == 4 and hashes[0] == hashes[1] and hashes[2] == hashes[3]
    assert os.path.exists(tmp_path / "rank1" / "latents")


def test_set_changes_the_seed_on_every_rank(ranks, tmp_path):
    a = submit(ranks, TINY, "--out", str(tmp_path / "a"), "--set", "KSampler.seed=7")
    b = submit(ranks, TINY, "--out", str(tmp_path / "b"), "--set", "5.seed=8")
    assert a.returncode == 0 and b.returncode == 0, a.stdout + a.stderr + b.stdout + b.stderr
    ha, hb = _hashes(a.stdout), _hashes(b.stdout)
    assert ha[0] == ha[1] and hb[0] == hb[1] and ha[0] != hb[0]


def test_ui_format_refused_with_hint(tmp_path):
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "tp2-submit"), os.path.join(ROOT, "workflows", "h3_tp2_tiny_demo.json"), "--ports", "1,2"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2
    assert "is a UI-format workflow" in res.stderr and "Export (API)" in res.stderr and "workflows/api/h3_tp2_tiny_demo.json" in res.stderr


def test_bad_set_refused():
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "tp2-submit"), TINY, "--ports", "1,2", "--set", "SaveLatent.filename_prefix=x"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2 and "matches 2 nodes; use a node id" in res.stderr


def test_every_bundled_workflow_is_valid_and_ui_agrees_with_api(ranks):
    port = ranks["ports"][0]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/object_info", timeout=30) as r:
        info = json.loads(r.read())
    assert len(API_FILES) == 6
    for path in API_FILES:
        name = os.path.basename(path)
        api = json.load(open(path))
        problems = _validate(api, info)
        assert not problems, f"{name}: {problems}"
        ui = json.load(open(os.path.join(ROOT, "workflows", name)))
        assert make_workflows.ui_to_api(ui, info) == api, f"{name}: UI and API forms differ"
        if name.startswith("h3_tp2_t2v") or name.startswith(("h3_tp2_i2v", "h3_tp2_flf2v")):
            classes = {n["class_type"] for n in api.values()}
            assert {"VAEDecodeAudio", "CreateVideo", "SaveVideo"} <= classes, name
            create = next(n for n in api.values() if n["class_type"] == "CreateVideo")
            assert api[create["inputs"]["audio"][0]]["class_type"] == "VAEDecodeAudio"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/workflow_templates", timeout=30) as r:
        templates = json.loads(r.read())
    assert sorted(templates["minimax-h3-tp2"]) == sorted(os.path.basename(p)[:-5] for p in API_FILES)


def _validate(api: dict, info: dict) -> list[str]:
    problems = []
    for nid, node in api.items():
        cls = node["class_type"]
        if cls not in info:
            problems.append(f"{nid}: unknown class {cls}")
            continue
        spec = {**info[cls]["input"].get("required", {}), **info[cls]["input"].get("optional", {})}
        for name in info[cls]["input"].get("required", {}):
            if name not in node["inputs"]:
                problems.append(f"{nid} {cls}: missing required input {name}")
        for name, value in node["inputs"].items():
            if name not in spec:
                problems.append(f"{nid} {cls}: unknown input {name}")
                continue
            kind, opts = spec[name][0], (spec[name][1] if len(spec[name]) > 1 else {})
            if isinstance(value, list):
                src = api.get(value[0])
                out = info[src["class_type"]]["output"][value[1]] if src else None
                if out != kind:
                    problems.append(f"{nid} {cls}.{name}: linked to {out}, needs {kind}")
            elif isinstance(kind, list) or kind == "COMBO":
                options = kind if isinstance(kind, list) else opts.get("options", [])
                if value not in options:
                    problems.append(f"{nid} {cls}.{name}: {value!r} not in {options[:8]}")
            elif kind in ("INT", "FLOAT") and not (opts.get("min", -1e30) <= value <= opts.get("max", 1e30)):
                problems.append(f"{nid} {cls}.{name}: {value} outside [{opts.get('min')}, {opts.get('max')}]")
    return problems


def test_rank_killed_mid_run_fails_fast_naming_the_rank(ranks, tmp_path):
    """Last: it kills rank 1 (the fixture's stop still cleans up)."""
    wf = json.load(open(TINY))
    wf["5"]["inputs"]["steps"] = 400
    path = tmp_path / "long.json"
    path.write_text(json.dumps(wf))
    cmd = [
        sys.executable,
        os.path.join(SCRIPTS, "tp2-submit"),
        str(path),
        "--ports",
        ",".join(map(str, ranks["ports"])),
        "--quiet",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(5)
    pid1 = int(open(ranks["run"] / "ranks" / "pids").read().split("\n")[1].split()[1])
    os.killpg(pid1, signal.SIGKILL)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=90)
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 1, out + err
    assert "error: rank" in err and ("rank 1 (port" in err or "rank 0 (port" in err), err
    status = subprocess.run(
        [os.path.join(SCRIPTS, "start-tp2.sh"), "status", "--run-dir", str(ranks["run"] / "ranks")], capture_output=True, text=True
    )
    assert "rank 1:" in status.stdout and "killed by signal 9 (KILL)" in status.stdout, status.stdout  # restarted by the launcher


def test_demo_command_end_to_end(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, TP2_DEMO_PORT=str(free_port()))
    res = subprocess.run(
        ["bash", os.path.join(SCRIPTS, "demo.sh"), "--cpu", "--run-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("latents[0]: identical") == 2 and "4/4 verified" in res.stdout
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes of the demo left running: {left}"
