"""The README followed on a fresh clone, in a temporary HOME, as a new user would (issue 18's first evidence item).

From a `git clone` of HEAD, with HOME fresh and empty, each command as the README writes it (changed only where it allows):
1. `scripts/install.sh --comfyui DIR`, DIR a copy of the suite's ComfyUI (COMFYUI_DIR: code copied, models/ empty folders);
2. `scripts/demo.sh --base-port N` (free ports), no --comfyui: it must use DIR, remembered by the set-up;
3. `scripts/start-tp2.sh --tp-size 2 --cpu --base-port M` (its `--gpus 0,1` without GPUs, per the troubleshooting table);
4. `scripts/tp2-submit workflows/api/h3_tp2_tiny_demo.json --run-dir tp2-run --set KSampler.seed=7` (the tiny workflow the demo
   left in DIR, for the 832x480 one) from a shell whose `python3` is PATH's, without aiohttp: tp2-submit must find the set-up's Python;
5. `scripts/start-tp2.sh status`; 6. `scripts/start-tp2.sh stop`.
Each must exit 0; set-up, demo and launcher must name DIR; the ranks tp2-submit, status and stop reach must be DIR's (their
working folder) under the set-up's Python; tp2-submit exits 0 only when every rank wrote identical files, checked again here.

DIR has the layout of the suite's ComfyUI (issue 49). Where that ComfyUI has its own virtualenv (venv/ or .venv/, as ComfyUI's
README and the ComfyUI-Manager way set it up), DIR gets a virtualenv of its own at venv/ that sees the suite's packages through a
.pth file (a 7 GB copy would prove nothing more): the set-up must use it, make no .venv in the clone, and install no second
torch. Where it has none, the set-up makes the clone's .venv: a real virtualenv (torch, ComfyUI's and the pack's requirements)
with the real user's pip config and cache (PIP_CONFIG_FILE, PIP_CACHE_DIR; scripts/install.sh has no wheel reuse of its own): it
needs the package registry, as a user's does, and fails without it (not skipped). Clone, venvs and DIR are removed afterwards
(kept with TP2_KEEP_TEST_DIRS=1).
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time

import pytest
from comfy_harness import COMFYUI_DIR, ROOT, cleanup, free_port, have_comfyui, venv_with_the_suites_packages

pytestmark = [
    pytest.mark.comfy,
    pytest.mark.slow,
    pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}"),
]

SETUP_TIMEOUT_S = 1800  # a cold pip cache fetching torch and the NVIDIA wheels from the network can take this long
TOP_LEVEL_NOT_COPIED = {".git", "models", "custom_nodes", "output", "temp", "user", "__pycache__", "venv", ".venv"}
# the suite's ComfyUI runs with a virtualenv of its own (the ComfyUI-Manager way): DIR then gets one too
COMFYUI_HAS_VENV = any(os.path.isfile(os.path.join(COMFYUI_DIR, v, "bin", "python")) for v in ("venv", ".venv"))


def _two_free_ports() -> int:
    """A port N with N and N + 1 free on loopback (the README's commands take N for rank 0, N + 1 for rank 1)."""
    for _ in range(50):
        port = free_port()
        if port >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _copy_comfyui(dest: str) -> str:
    """DIR: the suite's ComfyUI code copied (no .git, no virtualenv); models/ as its folder tree without files (a user's
    real models could be tens of GB, and the demo writes its tiny files there); custom_nodes/, output/, temp/, user/ empty;
    a venv/ of its own when the suite's ComfyUI has one."""
    shutil.copytree(
        COMFYUI_DIR, dest, symlinks=True,
        ignore=lambda d, names: [n for n in names if n == "__pycache__" or (d == COMFYUI_DIR and n in TOP_LEVEL_NOT_COPIED)],
    )  # fmt: skip
    models = os.path.join(COMFYUI_DIR, "models")
    for d, _dirs, _files in os.walk(models):
        os.makedirs(os.path.join(dest, "models", os.path.relpath(d, models)), exist_ok=True)
    for sub in ("custom_nodes", "output", "temp", "user"):
        os.makedirs(os.path.join(dest, sub), exist_ok=True)
    if COMFYUI_HAS_VENV:
        venv_with_the_suites_packages(os.path.join(dest, "venv"))
    return os.path.realpath(dest)


def _user_env(home: str) -> dict[str, str]:
    """The environment of a new user's shell: HOME fresh; no COMFYUI_DIR, PYTHON, TP2_*/MASTER_* or virtualenv of
    this test run (not on PATH either); the real user's pip configuration and cache, which the new HOME would hide."""
    real_home = pwd.getpwuid(os.getuid()).pw_dir
    drop = {"COMFYUI_DIR", "PYTHON", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PIP_CONFIG_FILE", "PIP_CACHE_DIR"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("TP2_", "MASTER_"))}
    own_bins = {os.path.realpath(os.path.join(p, "bin")) for p in {sys.prefix, os.path.join(ROOT, ".venv")} if p != sys.base_prefix}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep) if os.path.realpath(p) not in own_bins)
    env["HOME"] = home
    env["PIP_CACHE_DIR"] = os.environ.get("PIP_CACHE_DIR") or os.path.join(real_home, ".cache", "pip")
    config = os.environ.get("PIP_CONFIG_FILE") or next(
        (
            c
            for c in (os.path.join(real_home, ".config", "pip", "pip.conf"), os.path.join(real_home, ".pip", "pip.conf"))
            if os.path.isfile(c)
        ),
        None,
    )
    if config:
        env["PIP_CONFIG_FILE"] = config
    return env


def _run(cmd: str, cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """One README command, as a shell runs it from the pack's folder."""
    res = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    res.cmd_text = f"$ {cmd}\n--- stdout ---\n{res.stdout[-6000:]}\n--- stderr ---\n{res.stderr[-6000:]}"
    return res


def _ranks(run_dir: str) -> list[tuple[int, int, int]]:
    """(rank, pid, port) from the launcher's pids file."""
    with open(os.path.join(run_dir, "pids")) as f:
        return [tuple(int(x) for x in line.split()) for line in f if line.strip()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _assert_ranks_run(run_dir: str, comfy: str, venv_python: str, ports: list[int]) -> None:
    """The launcher's ranks are ComfyUI processes of `comfy` (their working folder, where the launcher cds to run
    main.py) under the set-up's Python, on `ports`."""
    ranks = _ranks(run_dir)
    assert [port for _, _, port in ranks] == ports, ranks
    for rank, pid, _port in ranks:
        assert _alive(pid), f"rank {rank} (pid {pid}) is not running"
        cwd = os.path.realpath(f"/proc/{pid}/cwd")
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        assert cwd == comfy, f"rank {rank} runs in {cwd}, not in {comfy}"
        assert argv[0].decode() == venv_python and argv[1] == b"main.py", argv


def _latents(folder: str) -> dict[str, bytes]:
    """Every downloaded file under a rank's folder: {relative path: content}."""
    walk = [os.path.join(d, name) for d, _dirs, files in os.walk(folder) for name in files]
    return {os.path.relpath(path, folder): open(path, "rb").read() for path in walk}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("readme_fresh_clone"))
    home = os.path.join(root, "home")
    os.makedirs(home)
    pack = os.path.join(root, "minimax-h3-tp2")
    subprocess.run(["git", "clone", "-q", ROOT, pack], check=True, capture_output=True, timeout=120)
    pack = os.path.realpath(pack)
    comfy = _copy_comfyui(os.path.join(root, "ComfyUI"))
    env = _user_env(home)
    shared_models = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(COMFYUI_DIR, "models")) for f in fs)
    t0 = time.monotonic()
    setup = _run(f"scripts/install.sh --comfyui {comfy}", pack, env, SETUP_TIMEOUT_S)
    setup.took = time.monotonic() - t0
    print(f"\n[readme fresh clone] set-up took {setup.took:.0f} s")
    python = f"{comfy}/venv/bin/python" if COMFYUI_HAS_VENV else f"{pack}/.venv/bin/python"  # what the set-up must use
    yield {"root": root, "home": home, "pack": pack, "comfy": comfy, "env": env, "setup": setup, "shared_models": shared_models,
           "python": python}  # fmt: skip
    for run_dir in ("tp2-run", os.path.join("tp2-demo", "ranks")):  # whatever a failed step left running
        if os.path.exists(os.path.join(pack, run_dir, "pids")):
            subprocess.run([os.path.join(pack, "scripts", "start-tp2.sh"), "stop", "--run-dir", os.path.join(pack, run_dir)],
                           env=env, capture_output=True, timeout=120)  # fmt: skip
    cleanup(root)


def test_setup_with_comfyui_dir(fresh):
    """`scripts/install.sh --comfyui DIR` in a fresh clone: DIR said first and last, remembered in the clone's .comfyui-dir,
    the clone linked into DIR/custom_nodes; the Python: DIR's own venv/ where it has one (no .venv, no second torch), else
    a new .venv of the clone's."""
    setup, pack, comfy, python = fresh["setup"], fresh["pack"], fresh["comfy"], fresh["python"]
    assert setup.returncode == 0, setup.cmd_text
    lines = setup.stdout.splitlines()
    assert lines[0] == f"[install] ComfyUI: {comfy} (--comfyui)", setup.cmd_text
    if COMFYUI_HAS_VENV:
        assert f"[install] using the Python your ComfyUI runs with ({comfy}/venv): no second torch" in setup.stdout, setup.cmd_text
        assert "creating virtualenv" not in setup.stdout and not os.path.exists(os.path.join(pack, ".venv")), setup.cmd_text
        assert not glob.glob(os.path.join(comfy, "venv", "lib", "python*", "site-packages", "torch")), "torch was installed again"
    else:
        assert f"[install] creating virtualenv {pack}/.venv" in lines, setup.cmd_text
    assert f"[install] remembered {comfy} in {pack}/.comfyui-dir" in setup.stdout, setup.cmd_text
    assert f"[install] linked the pack into {comfy}/custom_nodes/minimax-h3-tp2" in lines, setup.cmd_text
    assert any(ln.startswith("[install] ready: torch ") for ln in lines), setup.cmd_text
    assert lines[-2:] == [f"[install] ComfyUI: {comfy}", f"[install] python: {python}"], setup.cmd_text
    assert open(os.path.join(pack, ".comfyui-dir")).read().splitlines()[0] == comfy
    assert os.path.realpath(os.path.join(comfy, "custom_nodes", "minimax-h3-tp2")) == pack
    assert os.path.isfile(python) and os.path.realpath(pack) != os.path.realpath(ROOT)


def test_demo_launcher_submit_status_stop(fresh):
    """Demo, launcher, tp2-submit, status and stop, as the README writes them, on the clone after its set-up."""
    setup, pack, comfy, env = fresh["setup"], fresh["pack"], fresh["comfy"], fresh["env"]
    assert setup.returncode == 0, "the set-up failed (test_setup_with_comfyui_dir says how)"
    venv_python = fresh["python"]
    remembered = f"ComfyUI: {comfy} (remembered by scripts/install.sh in {pack}/.comfyui-dir)"

    # the demo, given no --comfyui: DIR, as the set-up remembered it
    port = _two_free_ports()
    demo = _run(f"scripts/demo.sh --base-port {port}", pack, env, 600)
    assert demo.returncode == 0, demo.cmd_text
    assert demo.stdout.splitlines()[0] == remembered, demo.cmd_text
    assert f"1/4 synthetic H3 checkpoint, conditioning and VAE, in {comfy}/models" in demo.stdout, demo.cmd_text
    assert f"ComfyUI: {comfy} (--comfyui)" in demo.stdout and f"starting 2 ranks of {comfy} under {venv_python}" in demo.stdout, (
        demo.cmd_text
    )
    assert f"rank 0: http://127.0.0.1:{port} " in demo.stdout and f"rank 1: http://127.0.0.1:{port + 1} " in demo.stdout, demo.cmd_text
    assert demo.stdout.count("latents[0]: identical") == 2 and "images[0]: identical" in demo.stdout, demo.cmd_text
    assert "4/4 verified" in demo.stdout and "tp2-demo/outputs/rank0/h3_tiny_demo_" in demo.stdout, demo.cmd_text
    tiny = json.load(open(os.path.join(pack, "workflows", "api", "h3_tp2_tiny_demo.json")))
    inputs = {n["class_type"]: n["inputs"] for n in tiny.values()}
    for folder, name in (
        ("diffusion_models", inputs["UNETLoader"]["unet_name"]),
        ("h3_conditioning", inputs["LoadH3Conditioning"]["file"]),
        ("vae", inputs["VAELoader"]["vae_name"]),
    ):
        left = os.path.join(comfy, "models", folder, name)
        assert os.path.isfile(left) and not os.path.islink(left), f"the demo left no {left}"
    assert not os.path.exists(os.path.join(pack, "tp2-demo", "ranks", "pids")), "the demo left its ranks recorded as running"
    shared_now = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(COMFYUI_DIR, "models")) for f in fs)
    assert shared_now == fresh["shared_models"], "the shared ComfyUI's models/ changed"

    # the launcher, the README's form on the CPU: DIR again, with the tiny model the demo left there
    port = _two_free_ports()
    start = _run(f"scripts/start-tp2.sh --tp-size 2 --cpu --base-port {port}", pack, env, 400)
    assert start.returncode == 0, start.cmd_text
    assert start.stdout.splitlines()[0] == remembered, start.cmd_text
    assert f"minimax-h3-tp2: starting 2 ranks of {comfy} under {venv_python}" in start.stdout, start.cmd_text
    assert "tp_size 2: fits h3_tiny_int8.safetensors" in start.stdout, start.cmd_text
    assert f"rank 0: http://127.0.0.1:{port}  cpu" in start.stdout and f"rank 1: http://127.0.0.1:{port + 1}  cpu" in start.stdout, (
        start.cmd_text
    )
    assert "       scripts/tp2-submit WORKFLOW.json --run-dir " in start.stdout, start.cmd_text
    run_dir = os.path.join(pack, "tp2-run")
    _assert_ranks_run(run_dir, comfy, venv_python, [port, port + 1])

    # tp2-submit, the README's command on the tiny workflow: every rank's files identical
    submit = _run("scripts/tp2-submit workflows/api/h3_tp2_tiny_demo.json --run-dir tp2-run --set KSampler.seed=7", pack, env, 400)
    assert submit.returncode == 0, submit.cmd_text
    assert submit.stdout.count(": identical") == 3 and "DIFFERENT" not in submit.stdout, submit.cmd_text
    outputs = [_latents(os.path.join(pack, "tp2-outputs", f"rank{r}")) for r in (0, 1)]
    assert len(outputs[0]) == 3 and outputs[0] == outputs[1], {r: sorted(o) for r, o in enumerate(outputs)}
    _assert_ranks_run(run_dir, comfy, venv_python, [port, port + 1])  # the same ranks of DIR answered it

    # status: both ranks of DIR up
    status = _run("scripts/start-tp2.sh status", pack, env, 120)
    assert status.returncode == 0, status.cmd_text
    for r, p in ((0, port), (1, port + 1)):
        assert f"rank {r}: up, http://127.0.0.1:{p} " in status.stdout, status.cmd_text
    assert "restart" not in status.stdout.replace("(restarted if it exits)", ""), status.cmd_text
    ranks = _ranks(run_dir)

    # stop: exactly those processes, nothing left
    stop = _run("scripts/start-tp2.sh stop", pack, env, 120)
    assert stop.returncode == 0, stop.cmd_text
    assert f"stopped the ranks of {run_dir}" in stop.stdout, stop.cmd_text
    assert not os.path.exists(os.path.join(run_dir, "pids")), os.listdir(run_dir)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for _, pid, _ in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for _, pid, _ in ranks if _alive(pid)], f"ranks still running after stop: {ranks}"
    left = subprocess.run(["pgrep", "-f", fresh["root"]], capture_output=True, text=True).stdout.split()
    assert not [p for p in left if int(p) != os.getpid()], f"processes of the fresh clone left running: {left}"


def test_newest_allowed_comfy_kitchen_imports_in_a_clean_venv(tmp_path):
    """A fresh install gets what the pack imports: a clean virtualenv with torch (the CPU build, ComfyUI's part) and the
    pack's requirements.txt at their newest allowed versions (pip's choice, not ComfyUI's pins) imports every pack
    module that imports comfy-kitchen. comfy-kitchen 0.2.40 imports `packaging` without declaring it."""
    venv = str(tmp_path / "venv")
    py = os.path.join(venv, "bin", "python")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch = subprocess.run([*pip, "torch==2.13.0"], capture_output=True, text=True, timeout=900)  # the CPU file on disk
    assert torch.returncode == 0, torch.stderr[-2000:]
    reqs = subprocess.run([*pip, "--upgrade", "-r", os.path.join(ROOT, "requirements.txt")], capture_output=True, text=True, timeout=600)
    assert reqs.returncode == 0, reqs.stderr[-2000:]
    probe = "import importlib.metadata as m, comfy_kitchen, kernels.int8_gemm, kernels.int8_split; print(m.version('comfy-kitchen'))"
    res = subprocess.run([py, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"the pack does not import in a clean install:\n{res.stderr[-3000:]}"
    print(f"\n[clean venv] comfy-kitchen {res.stdout.strip()} imports with the pack's requirements alone")
