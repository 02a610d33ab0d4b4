"""The product path on real ComfyUI: scripts/start-tp2.sh starts two CPU ranks, scripts/tp2-submit drives them,
`stop` leaves nothing behind; the bundled workflows are valid against the live /object_info (with the pack
loaded) and their UI and API forms agree; a tp_size the checkpoint cannot split is refused before any rank starts;
the demo command runs end to end and leaves the tiny workflow's files in its ComfyUI."""

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
import torch
from comfy_harness import COMFYUI_DIR, ROOT, call, free_port, have_comfyui, launch, stop_launched, tiny_base
from safetensors.torch import save_file

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

SCRIPTS = os.path.join(ROOT, "scripts")
TINY = os.path.join(ROOT, "workflows", "api", "h3_tp2_tiny_demo.json")
NOT_H3_LORA = "not_h3_lora.safetensors"
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
    os.makedirs(os.path.join(base, "models", "loras"), exist_ok=True)  # a LoRA of another model: no key is H3's
    other = {f"lora_unet_down_blocks_{i}_attn1_to_q.{f}.weight": torch.zeros(4, 4) for i in range(3) for f in ("lora_up", "lora_down")}
    save_file(other, os.path.join(base, "models", "loras", NOT_H3_LORA))
    os.makedirs(os.path.join(base, "input"), exist_ok=True)
    for name in ("h3_first_frame.png", "h3_last_frame.png"):
        Image.new("RGB", (64, 64), (120, 80, 40)).save(os.path.join(base, "input", name))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    run = tmp_path_factory.mktemp("launcher")
    base = tiny_base(run)
    _placeholders(base)
    # TP2_BLOCK_MS: rank 1's block three times rank 0's, for the link's speed-up prediction
    launched = launch(run, base, {"TP2_PROMPT_TIMEOUT_S": "15", "TP2_TIMEOUT_S": "20", "TP2_BLOCK_MS": "10,30"})
    assert "rank 0: http://127.0.0.1:" in launched["stdout"] and "settings: TP2_INT8_KERNEL=auto" in launched["stdout"]
    yield dict(launched, run=run)
    stop = stop_launched(launched)
    assert stop.returncode == 0, stop.stderr


def test_a_lora_that_patches_nothing_is_a_warning_at_the_client(ranks, tmp_path):
    """A LoRA of another model (SD-style keys) in LoraLoaderModelOnly patches nothing of H3: tp2-submit prints the
    node's warning, with how many layers matched, and its closing line counts it; the run still succeeds identically.
    The warning is in the prompt's history on every rank (what tp2-submit reads when its websocket missed it; issue 49),
    and a second run, whose LoRA node ComfyUI's cache serves, warns again."""
    wf = json.load(open(TINY))
    wf["20"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": NOT_H3_LORA, "strength_model": 1.0}}
    wf["5"]["inputs"]["model"] = ["20", 0]
    path = tmp_path / "with_lora.json"
    path.write_text(json.dumps(wf))
    warning = "WARNING from LoraLoaderModelOnly (node 20): LoRA "
    for run in ("first", "cached"):
        res = submit(ranks, str(path), "--out", str(tmp_path / run))
        assert res.returncode == 0, res.stdout + res.stderr
        assert warning in res.stderr and "patched nothing of the model (0 of its 3 layers matched)" in res.stderr, res.stderr
        assert res.stderr.count(warning) == 1, res.stderr  # every rank sends it; said once
        assert ", with 1 warning(s) (above: check them)" in res.stdout.splitlines()[0], res.stdout
        prompt_id = res.stdout.split("finished prompt ", 1)[1].split()[0]
        for url in ranks["urls"]:
            messages = call(url, f"/history/{prompt_id}")[1][prompt_id]["status"]["messages"]
            told = [w for kind, d in messages if kind == "tp2_warnings" for w in d["warnings"]]
            assert [w["node_id"] for w in told] == ["20"] and "patched nothing" in told[0]["text"], (url, run, messages)
            if run == "cached":
                assert any(kind == "execution_cached" and "20" in d["nodes"] for kind, d in messages), messages


def test_tp_size_the_checkpoint_cannot_split_is_refused_before_any_rank(tmp_path):
    """The launcher as the README runs it, with --tp-size 3 and the tiny int8 model (it splits 1 or 2 ways) in the
    ComfyUI's diffusion_models: refused within 5 s (importing torch included) with the sizes that work, and no rank
    started (no pids file, no rank log). It runs before the `ranks` fixture starts its servers, which would slow it."""
    from conftest import assert_refused_quickly

    base = tiny_base(tmp_path)
    run_dir = tmp_path / "ranks"
    t0 = time.monotonic()
    res = subprocess.run(
        [os.path.join(SCRIPTS, "start-tp2.sh"), "--comfyui", COMFYUI_DIR, "--tp-size", "3", "--cpu", "--run-dir", str(run_dir),
         "--base-dir", base, "--base-port", str(free_port())],
        env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert res.returncode == 1, res.stdout + res.stderr
    assert "tp_size 3 refused before starting any rank" in res.stderr and "Use tp_size 1 or 2." in res.stderr, res.stderr
    assert_refused_quickly(took)
    assert not (run_dir / "pids").exists() and not list(run_dir.glob("rank*")), os.listdir(run_dir)


def submit(ranks, *args, timeout=180):
    cmd = [sys.executable, os.path.join(SCRIPTS, "tp2-submit"), *args, "--ports", ",".join(map(str, ranks["ports"])), "--quiet"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _hashes(stdout: str) -> list[str]:
    return [line.split()[2] for line in stdout.splitlines() if line.strip().startswith("rank ") and ":" in line]


def test_submit_tiny_workflow_identical_hashes(ranks, tmp_path):
    res = submit(ranks, TINY, "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("identical") == 3
    hashes = _hashes(res.stdout)  # sha256 of each whole file: two .latent files and the animated WEBP
    assert len(hashes) == 6 and hashes[0::2] == hashes[1::2] and all(len(h) == 64 for h in hashes), res.stdout
    assert os.path.exists(tmp_path / "rank1" / "latents") and len(list(tmp_path.glob("rank1/h3_tiny_demo_*.webp"))) == 1


def test_the_link_measured_as_the_group_formed_is_in_status_and_log(ranks, tmp_path):
    """As the group forms (at the first sampler), the ranks time one all-reduce: every rank's /tp2/status names the link
    (gloo through host memory here) with a bus bandwidth, and the speed-up predicted from TP2_BLOCK_MS (10 and 30 ms:
    the even split runs at the slow rank's pace, under the fastest card alone) says plainly that TP buys memory."""
    res = submit(ranks, TINY, "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    for url in ranks["urls"]:
        _, status = call(url, "/tp2/status")
        link = status["group"]["link"]
        assert link["kind"] == "gloo, host memory" and link["mib"] == 8 and 0 < link["bus_gbps"] < 1000 and link["ms"] > 0, link
        assert link["prediction"].startswith("predicted 0.") and "at 1:1: TP buys memory here, not speed" in link["prediction"], link
    with open(os.path.join(ranks["run_dir"], "rank0.log")) as f:
        log = f.read()
    assert "formed; link: " in log and "GB/s bus bandwidth (gloo, host memory; one 8 MiB all-reduce in" in log, log[-3000:]


def test_submit_names_every_missing_model_file_and_its_folder(ranks, tmp_path):
    """The bundled 832x480 workflow with none of its four model files present: tp2-submit exits 1 and names each file
    with the folder it belongs in (ComfyUI's refusal lists them per node)."""
    wf = json.load(open(os.path.join(ROOT, "workflows", "api", "h3_tp2_t2v_832x480.json")))
    missing = {}
    for node in wf.values():
        for name in ("unet_name", "clip_name", "vae_name"):
            if name in node["inputs"]:
                node["inputs"][name] = "absent_" + node["inputs"][name]
                missing[node["inputs"][name]] = make_workflows.RELEASE[node["inputs"][name][len("absent_") :]]
    path = tmp_path / "missing.json"
    path.write_text(json.dumps(wf))
    res = submit(ranks, str(path))
    assert res.returncode == 1, res.stdout + res.stderr
    assert len(missing) == 4
    for name, folder in missing.items():
        assert f"missing model file '{name}': put it in ComfyUI/models/{folder}/" in res.stderr, res.stderr


def _python_without_aiohttp() -> str | None:
    base = os.path.join(sys.base_prefix, "bin", "python3")  # the interpreter this test's venv was made from
    has = subprocess.run([base, "-c", "import aiohttp"], capture_output=True).returncode == 0
    return None if has else base


def test_printed_submit_hint_works_as_printed(ranks, tmp_path):
    """The launcher's hint, run by a shell whose `python3` has no aiohttp (what the README's users have): tp2-submit
    runs itself again under the Python of the scripts' rule ($PYTHON where set, else ComfyUI's venv/ in the Manager
    layout, else the pack's .venv: never skipped for want of a .venv), and both ranks agree. Then the printed `status` line."""
    base = _python_without_aiohttp()
    if base is None:
        pytest.skip(f"{sys.base_prefix}/bin/python3 has aiohttp: nothing would need the venv")
    env = {k: v for k, v in os.environ.items() if k not in ("TP2_VENV", "TP2_SUBMIT_IN_VENV")}
    rule = subprocess.run(["bash", os.path.join(SCRIPTS, "lib", "comfyui_dir.sh"), "--print"], env=env, capture_output=True, text=True)
    assert rule.stdout.splitlines()[3] != "python3 on PATH", f"the rule finds no Python with the pack's requirements: {rule.stdout}"
    hint = next(ln.strip() for ln in ranks["stdout"].splitlines() if "tp2-submit WORKFLOW.json --run-dir" in ln)
    status = next(ln.split(":", 1)[1].strip() for ln in ranks["stdout"].splitlines() if ln.startswith("status:"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(base, bin_dir / "python3")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    cmd = hint.replace("WORKFLOW.json", TINY) + f" --out {tmp_path / 'out'} --quiet"
    res = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, cmd + "\n" + res.stdout + res.stderr
    assert res.stdout.count("identical") == 3, res.stdout
    up = subprocess.run(status, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert up.returncode == 0 and up.stdout.count(": up, http://") == 2, up.stdout + up.stderr


def test_set_changes_the_seed_on_every_rank(ranks, tmp_path):
    a = submit(ranks, TINY, "--out", str(tmp_path / "a"), "--set", "KSampler.seed=7")
    b = submit(ranks, TINY, "--out", str(tmp_path / "b"), "--set", "5.seed=8")
    assert a.returncode == 0 and b.returncode == 0, a.stdout + a.stderr + b.stdout + b.stderr
    ha, hb = _hashes(a.stdout), _hashes(b.stdout)
    assert ha[0] == ha[1] and hb[0] == hb[1] and ha[0] != hb[0]


def test_submit_in_a_terminal_shows_every_ranks_sampler_steps(ranks, tmp_path):
    """Every rank's progress reaches tp2-submit (issue 18): its websocket on each rank uses one client id, rank 0
    hands the prompt on with that id in extra_data, and each follower sends its own steps to it. Run in a
    pseudo-terminal, where tp2-submit redraws its line at every change (a pipe gets a line every 2 s at most)."""
    import pty
    import re

    steps = 6
    master, slave = pty.openpty()
    cmd = [sys.executable, os.path.join(SCRIPTS, "tp2-submit"), TINY, "--ports", ",".join(map(str, ranks["ports"])), "--out", str(tmp_path),
           "--set", f"KSampler.steps={steps}", "--set", f"KSampler.seed={int(time.time()) % 100000 + 500}"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the terminal's last writer closed it
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    stdout = proc.communicate(timeout=180)[0].decode()
    terminal = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, stdout + terminal
    for rank in (0, 1):
        seen = {int(k) for k in re.findall(rf"rank {rank}: KSampler (\d+)/{steps}", terminal)}
        assert len(seen) >= 3 and steps in seen, f"rank {rank} showed steps {sorted(seen)}:\n{terminal[-3000:]}"


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


def test_a_rank_the_launcher_restarts_is_waited_for_and_said_so(ranks, tmp_path):
    """A killed rank that the launcher starts again (issue 49: tp2-submit said 'not reachable ... is the rank running?'
    while `status` knew better): rank 0's /tp2/cluster calls the follower "restarting"; tp2-submit --run-dir says the
    rank is restarting, waits for it, and the run succeeds identically. Then the same with rank 0 killed."""
    run_dir = ranks["run"] / "ranks"
    for victim in (1, 0):
        pid = int(open(run_dir / "pids").read().split("\n")[victim].split()[1])
        os.killpg(pid, signal.SIGKILL)
        if victim == 1:  # the launcher starts it again after a second, and ComfyUI takes longer than that to answer
            _, cluster = call(ranks["urls"][0], "/tp2/cluster")
            assert cluster["ranks"][1]["health"] == "restarting", cluster["ranks"][1]
        cmd = [sys.executable, os.path.join(SCRIPTS, "tp2-submit"), TINY, "--run-dir", str(run_dir), "--out", str(tmp_path / str(victim)),
               "--quiet", "--set", f"KSampler.seed={300 + victim}"]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
        assert res.returncode == 0, res.stdout + res.stderr
        said = f"tp2-submit: rank {victim} ({ranks['urls'][victim]}) is restarting: its process ended and the launcher is starting it"
        assert said in res.stderr, res.stderr
        assert "not reachable" not in res.stderr and res.stdout.count(": identical") == 3, res.stdout + res.stderr


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


def _comfyui_with_own_models(path) -> str:
    """This ComfyUI's code (every entry linked) with a models/ folder of its own, so the demo's files land there."""
    os.makedirs(path / "models")
    for entry in os.listdir(COMFYUI_DIR):
        if entry != "models":
            os.symlink(os.path.join(COMFYUI_DIR, entry), path / entry)
    return str(path)


def test_demo_command_end_to_end(tmp_path):
    """`scripts/demo.sh --cpu --base-port N --comfyui DIR`: both ranks agree, on the given ports (--base-port wins over
    TP2_DEMO_PORT), with DIR's ComfyUI, whose models/ keeps the three tiny files where the bundled tiny workflow
    (workflows/api/h3_tp2_tiny_demo.json) names them; the animated WEBP whose path it prints is the same bytes on
    both ranks; nothing left running."""
    comfy, port = _comfyui_with_own_models(tmp_path / "ComfyUI"), free_port()
    env = dict(os.environ, PYTHON=sys.executable, TP2_DEMO_PORT="1")
    res = subprocess.run(
        ["bash", os.path.join(SCRIPTS, "demo.sh"), "--cpu", "--run-dir", str(tmp_path / "demo"), "--base-port", str(port), "--comfyui", comfy],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.startswith(f"ComfyUI: {comfy} (--comfyui)\n"), res.stdout[:500]
    assert res.stdout.count("latents[0]: identical") == 2 and "images[0]: identical" in res.stdout and "4/4 verified" in res.stdout
    assert f"rank 0: http://127.0.0.1:{port} " in res.stdout and f"rank 1: http://127.0.0.1:{port + 1} " in res.stdout
    video = res.stdout.split("so coloured noise): ", 1)[1].split("\n", 1)[0]  # the path it prints: an animated WEBP, rank 1's the same
    assert video.startswith(str(tmp_path / "demo" / "outputs" / "rank0")) and video.endswith(".webp"), res.stdout
    with open(video, "rb") as f, open(video.replace("/rank0/", "/rank1/"), "rb") as g:
        blob = f.read()
        assert blob[:4] == b"RIFF" and b"ANIM" in blob[:64] and blob == g.read()
    tiny = json.load(open(TINY))
    names = {n["class_type"]: n["inputs"] for n in tiny.values()}
    files = (
        ("diffusion_models", "UNETLoader", "unet_name"),
        ("h3_conditioning", "LoadH3Conditioning", "file"),
        ("vae", "VAELoader", "vae_name"),
    )
    for folder, name in ((folder, names[node][key]) for folder, node, key in files):
        left_file = os.path.join(comfy, "models", folder, name)
        assert os.path.isfile(left_file) and not os.path.islink(left_file) and os.path.getsize(left_file) > 1000, left_file
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes of the demo left running: {left}"
