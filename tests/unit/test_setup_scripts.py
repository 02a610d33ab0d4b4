"""The set-up scripts without a ComfyUI server: which ComfyUI they use (scripts/lib/comfyui_dir.sh: --comfyui >
$COMFYUI_DIR > the one scripts/install.sh remembered in <pack>/.comfyui-dir > ~/ComfyUI), said in one line by
install.sh, start-tp2.sh and demo.sh; a re-run of install.sh saying "already there" instead of "installing"; and
demo.sh's usage. (The demo's run itself: tests/comfy/test_launcher_client.py.)

Each test runs the real scripts from a copy of the pack's scripts/ (and tp2/, which the launcher's tp_size check
imports) in a temporary folder, so the .comfyui-dir they write is the copy's and never the checkout's. install.sh
runs against this test's own virtualenv (--venv), where everything is installed already, and a stand-in ComfyUI
(an empty main.py and custom_nodes/, no requirements.txt), so it installs nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = sys.prefix


@pytest.fixture
def pack(tmp_path):
    p = tmp_path / "pack"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(os.path.join(ROOT, "scripts"), p / "scripts", ignore=ignore)
    shutil.copytree(os.path.join(ROOT, "tp2"), p / "tp2", ignore=ignore)
    shutil.copy(os.path.join(ROOT, "requirements.txt"), p / "requirements.txt")
    return p


def stand_in_comfyui(path) -> str:
    (path / "custom_nodes").mkdir(parents=True)
    (path / "main.py").write_text("")
    return str(path)


def run(cmd, home, cwd, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TP2_", "COMFYUI_DIR"))}
    return subprocess.run(cmd, env=clean | {"HOME": str(home), **env}, cwd=cwd, capture_output=True, text=True, timeout=240)


def resolved(pack, home, *explicit, **env) -> list[str]:
    res = run(["bash", str(pack / "scripts" / "lib" / "comfyui_dir.sh"), "--print", *explicit], home, pack, **env)
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()[:2]


def test_precedence_flag_env_remembered_default(pack, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    assert resolved(pack, home) == [f"{home}/ComfyUI", "the default"]
    (pack / ".comfyui-dir").write_text("/remembered/ComfyUI\n")
    assert resolved(pack, home) == ["/remembered/ComfyUI", f"remembered by scripts/install.sh in {pack}/.comfyui-dir"]
    assert resolved(pack, home, COMFYUI_DIR="/from/env") == ["/from/env", "$COMFYUI_DIR"]
    assert resolved(pack, home, "/from/flag", COMFYUI_DIR="/from/env") == ["/from/flag", "--comfyui"]


def test_the_comfyui_holding_the_pack_and_its_python(tmp_path):
    """The pack in a ComfyUI's custom_nodes/ uses that ComfyUI (over the remembered one) and its venv/'s Python (over
    the pack's .venv); $COMFYUI_DIR and $PYTHON still win."""
    home, comfy = tmp_path / "home", tmp_path / "ComfyUI"
    home.mkdir()
    stand_in_comfyui(comfy)
    pack = comfy / "custom_nodes" / "minimax-h3-tp2"
    shutil.copytree(os.path.join(ROOT, "scripts"), pack / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    (pack / ".comfyui-dir").write_text("/remembered/ComfyUI\n")
    (comfy / "venv" / "bin").mkdir(parents=True)
    (comfy / "venv" / "bin" / "python").symlink_to(sys.executable)
    rule = ["bash", str(pack / "scripts" / "lib" / "comfyui_dir.sh"), "--print"]
    clean = {k: v for k, v in os.environ.items() if k not in ("COMFYUI_DIR", "PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX")}
    out = subprocess.run(rule, env=clean | {"HOME": str(home)}, capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == [str(comfy), "the ComfyUI whose custom_nodes holds the pack", f"{comfy}/venv/bin/python", "ComfyUI's own venv"]
    out = subprocess.run(rule, env=clean | {"HOME": str(home), "COMFYUI_DIR": "/from/env", "PYTHON": "/my/python"},
                         capture_output=True, text=True, check=True).stdout.splitlines()  # fmt: skip
    assert out == ["/from/env", "$COMFYUI_DIR", "/my/python", "$PYTHON"]


@pytest.mark.slow  # install.sh twice: about 30 s on 2 cores, most of it importing torch
def test_install_remembers_its_comfyui_and_everything_reads_it(pack, tmp_path):
    home, comfy, elsewhere = tmp_path / "home", tmp_path / "my ComfyUI", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    stand_in_comfyui(comfy)
    stand_in_comfyui(home / "ComfyUI")  # the default exists too, and must not be the one used
    install = ["bash", str(pack / "scripts" / "install.sh"), "--venv", VENV]

    first = run([*install, "--comfyui", str(comfy)], home, elsewhere)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (pack / ".comfyui-dir").read_text() == f"{comfy}\n"
    assert f"[install] ComfyUI: {comfy} (--comfyui)" in first.stdout
    assert f"remembered {comfy} in {pack}/.comfyui-dir" in first.stdout
    assert f"linked the pack into {comfy}/custom_nodes/minimax-h3-tp2" in first.stdout
    assert os.path.realpath(comfy / "custom_nodes" / "minimax-h3-tp2") == str(pack)

    again = run(install, home, elsewhere)  # no --comfyui: the remembered one, and nothing to do
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"[install] ComfyUI: {comfy} (remembered by scripts/install.sh in {pack}/.comfyui-dir)" in again.stdout
    assert "the pack's dependencies: already there" in again.stdout and "torch" in again.stdout
    assert "installing" not in again.stdout and "linked the pack" not in again.stdout, again.stdout
    assert not (home / "ComfyUI" / "custom_nodes" / "minimax-h3-tp2").exists()

    # the launcher: stopped by the missing GPUs (no --cpu, and no nvidia-smi on PATH), after saying its ComfyUI
    launcher = run(["bash", str(pack / "scripts" / "start-tp2.sh"), "--run-dir", str(tmp_path / "run")], home, elsewhere,
                   PATH=_path_without("nvidia-smi"), PYTHON=sys.executable)  # fmt: skip
    assert launcher.returncode == 1
    assert launcher.stdout.startswith(f"ComfyUI: {comfy} (remembered by scripts/install.sh in {pack}/.comfyui-dir)\n"), launcher.stdout
    assert "there is no nvidia-smi here" in launcher.stderr, launcher.stderr

    # the demo: its ComfyUI is gone, so it stops at once, naming the remembered one
    (comfy / "main.py").unlink()
    demo = run(["bash", str(pack / "scripts" / "demo.sh"), "--run-dir", str(tmp_path / "demo")], home, elsewhere, PYTHON=sys.executable)
    assert demo.returncode == 1
    assert demo.stdout.startswith(f"ComfyUI: {comfy} (remembered by scripts/install.sh in {pack}/.comfyui-dir)\n"), demo.stdout
    assert f"no ComfyUI at '{comfy}'" in demo.stderr and "--comfyui DIR" in demo.stderr, demo.stderr


def test_env_beats_the_remembered_comfyui(pack, tmp_path):
    home, comfy = tmp_path / "home", tmp_path / "other"
    home.mkdir()
    (pack / ".comfyui-dir").write_text(f"{tmp_path}/remembered\n")
    stand_in_comfyui(comfy)
    res = run(["bash", str(pack / "scripts" / "start-tp2.sh"), "--cpu", "--run-dir", str(tmp_path / "run")], home, tmp_path,
              COMFYUI_DIR=str(comfy), PYTHON=sys.executable)  # fmt: skip
    assert res.stdout.startswith(f"ComfyUI: {comfy} ($COMFYUI_DIR)\n"), res.stdout
    assert "the pack is not in" in res.stderr, res.stderr  # the stand-in has no link to this copy of the pack


def _path_without(program: str) -> str:
    return os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not os.path.exists(os.path.join(d, program)))


def test_demo_help_is_its_usage():
    res = subprocess.run(["bash", os.path.join(ROOT, "scripts", "demo.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0
    assert res.stdout.splitlines()[0].startswith("The first TP run, no downloads")
    for option in (
        "--comfyui DIR",
        "--base-port N",
        "--run-dir DIR",
        "--cpu",
        "$TP2_DEMO_PORT",
        "models/h3_conditioning/h3_tiny_cond.safetensors",
    ):
        assert option in res.stdout, option
    assert "set -euo" not in res.stdout and not any(line.startswith("#") for line in res.stdout.splitlines())


@pytest.mark.parametrize(
    "env,args,says", [({"TP2_DEMO_PORT": "x1"}, (), "got 'x1'"), ({"TP2_DEMO_PORT": "x1"}, ("--base-port", "x2"), "got 'x2'")]
)
def test_demo_port_from_env_or_flag(tmp_path, env, args, says):
    """TP2_DEMO_PORT is still read, and --base-port wins over it (a bad value shows which one was taken)."""
    res = run(["bash", os.path.join(ROOT, "scripts", "demo.sh"), *args], tmp_path, tmp_path, **env)
    assert res.returncode == 1 and says in res.stderr, res.stderr


def test_submit_without_aiohttp_or_venv_says_what_to_do(pack, tmp_path):
    """tp2-submit under a python3 without aiohttp, and no ComfyUI venv/ nor pack .venv by the rule: a clear message, exit 2."""
    base = os.path.join(sys.base_prefix, "bin", "python3")
    if subprocess.run([base, "-c", "import aiohttp"], capture_output=True).returncode == 0:
        pytest.skip(f"{base} has aiohttp")
    env = {k: v for k, v in os.environ.items() if k not in ("TP2_SUBMIT_IN_VENV", "PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX", "COMFYUI_DIR")}
    res = subprocess.run([base, str(pack / "scripts" / "tp2-submit"), "--help"], env=env | {"HOME": str(tmp_path)}, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert "needs the Python package aiohttp" in res.stderr and "run scripts/install.sh" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB filesystem (tmpfs), for the disk check; skipped where this user cannot mount one."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root): the disk check is not exercised")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_install_on_a_disk_without_room_stops_first_and_says_so(pack, tmp_path, small_disk):
    comfy = stand_in_comfyui(tmp_path / "ComfyUI")
    res = run(["bash", str(pack / "scripts" / "install.sh"), "--venv", str(small_disk / "venv"), "--comfyui", comfy], tmp_path, pack)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"GiB free on the disk of {small_disk}/venv; installing needs about 8 GiB" in res.stdout, res.stdout
    assert "--venv DIR" in res.stdout
    assert not (small_disk / "venv").exists(), "the virtualenv was created before the disk check refused"


def test_requirements_txt_is_pyprojects_dependencies_without_torch():
    """ComfyUI-Manager installs requirements.txt; the registry reads pyproject.toml: the same list, and never torch
    (the user's ComfyUI brings it)."""
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "requirements.txt")) as f:
        listed = [line.split("#", 1)[0].strip() for line in f if line.split("#", 1)[0].strip()]
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert listed == project["project"]["dependencies"], (listed, project["project"]["dependencies"])
    assert not any(r.split(">")[0].split("=")[0].strip().lower() in ("torch", "torchvision", "torchaudio") for r in listed)
    assert "comfy" in project["tool"] and project["tool"]["comfy"]["PublisherId"]


def test_install_reuses_the_virtualenv_comfyui_runs_with(pack, tmp_path):
    """A ComfyUI with its own working venv/ (here: this suite's virtualenv, torch and all): the set-up installs the
    pack's requirements there (already satisfied) and makes no second virtualenv, in seconds; --own-venv would."""
    import time

    comfy = tmp_path / "ComfyUI"
    stand_in_comfyui(comfy)
    os.symlink(VENV, comfy / "venv")
    t0 = time.monotonic()
    res = run(["bash", str(pack / "scripts" / "install.sh"), "--comfyui", str(comfy), "--no-link"], tmp_path, pack)
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"using the Python your ComfyUI runs with ({comfy}/venv): no second torch" in res.stdout, res.stdout
    assert "your ComfyUI's, left as it is" in res.stdout and "the pack's dependencies: already there" in res.stdout, res.stdout
    assert f"python: {comfy}/venv/bin/python" in res.stdout and not (pack / ".venv").exists()
    print(f"set-up reusing ComfyUI's virtualenv: {took:.1f} s")
    assert took < 60, took


def test_install_in_the_manager_layout_links_nothing_and_warns_of_nothing(tmp_path):
    """The pack cloned into ComfyUI's custom_nodes (the README's ComfyUI-Manager way), under any folder name, ComfyUI
    with its own venv/: install.sh, run from the pack with no --comfyui, finds that ComfyUI, says the pack sits there
    itself, and neither warns that its own folder "is not a link to this pack" nor links a second copy."""
    comfy = tmp_path / "ComfyUI"
    stand_in_comfyui(comfy)
    os.symlink(VENV, comfy / "venv")
    for name in ("minimax-h3-tp2", "minimax-h3-tp2-main"):
        pack = comfy / "custom_nodes" / name
        shutil.copytree(os.path.join(ROOT, "scripts"), pack / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(os.path.join(ROOT, "requirements.txt"), pack / "requirements.txt")
        res = run(["bash", str(pack / "scripts" / "install.sh")], tmp_path, pack)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.splitlines()[0] == f"[install] ComfyUI: {comfy} (the ComfyUI whose custom_nodes holds the pack)", res.stdout
        assert f"[install] the pack sits in {comfy}/custom_nodes itself: nothing to link" in res.stdout, res.stdout
        assert "WARNING" not in res.stdout + res.stderr and "linked the pack" not in res.stdout, res.stdout + res.stderr
        assert sorted(os.listdir(comfy / "custom_nodes"))[-1] == name and not any(
            os.path.islink(comfy / "custom_nodes" / n) for n in os.listdir(comfy / "custom_nodes")
        ), os.listdir(comfy / "custom_nodes")
        shutil.rmtree(pack)
