"""The ComfyUI-Manager way, from a fresh clone, as the README writes it: a ComfyUI with its own virtualenv (torch and
ComfyUI's requirements, no pack), the pack cloned into its custom_nodes/ and its requirements installed with pip into
that virtualenv; then, from the pack's folder, with nothing remembered, no --comfyui and no PYTHON: scripts/demo.sh
runs; scripts/start-tp2.sh --tp-size 2 --cpu finds that ComfyUI and runs both ranks under that virtualenv's Python (said
in its first lines); scripts/tp2-submit finds that Python by itself and proves both ranks wrote the same bytes of the
tiny demo workflow; a fixed MASTER_PORT comes up again right after `stop`; and no second torch is installed anywhere:
the virtualenv's own folder holds none (it sees the suite's packages through a .pth file, so nothing is downloaded)
and the clone has no .venv."""

from __future__ import annotations

import glob
import os
import subprocess

import pytest
from comfy_harness import COMFYUI_DIR, ROOT, have_comfyui, venv_with_the_suites_packages
from conftest import free_port, make_checkpoint, make_tiny_h3

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

OWN = ("custom_nodes", "models", "input", "output", "temp", "user", "venv", ".venv")  # the copy's own, not linked


def _comfyui_with_its_own_venv(comfy: str) -> str:
    os.makedirs(comfy)
    for entry in os.listdir(COMFYUI_DIR):
        if entry not in OWN:
            os.symlink(os.path.join(COMFYUI_DIR, entry), os.path.join(comfy, entry))
    for sub in ("custom_nodes", "models/diffusion_models", "models/h3_conditioning", "input", "output"):
        os.makedirs(os.path.join(comfy, sub))
    return venv_with_the_suites_packages(os.path.join(comfy, "venv"))  # torch and ComfyUI's requirements, as its venv holds them


def test_the_manager_way_runs_under_comfyuis_own_virtualenv(tmp_path):
    comfy = str(tmp_path / "ComfyUI")
    venv_py = _comfyui_with_its_own_venv(comfy)
    pack = os.path.join(comfy, "custom_nodes", "minimax-h3-tp2")
    subprocess.run(["git", "clone", "-q", ROOT, pack], check=True, timeout=120)
    pip = subprocess.run([venv_py, "-m", "pip", "install", "--disable-pip-version-check", "--no-index", "-r", os.path.join(pack, "requirements.txt")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert pip.returncode == 0, pip.stdout + pip.stderr
    make_checkpoint(os.path.join(comfy, "models/diffusion_models/h3_tiny_int8.safetensors"), "--int8")
    make_tiny_h3.main(["--conditioning", os.path.join(comfy, "models/h3_conditioning/h3_tiny_cond.safetensors")])
    make_tiny_h3.main(["--vae", os.path.join(comfy, "models/vae/h3_tiny_vae.safetensors")])

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX", "COMFYUI_DIR", "TP2_VENV")}
    env["PATH"] = "/usr/bin:/bin"  # the user's python3, not this suite's
    demo = subprocess.run([os.path.join(pack, "scripts", "demo.sh"), "--cpu", "--base-port", str(free_port())], env=env, cwd=pack,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert f"ComfyUI: {comfy} (the ComfyUI whose custom_nodes holds the pack)" in demo.stdout, demo.stdout
    assert f"Python: {venv_py} (ComfyUI's own venv)" in demo.stdout, demo.stdout
    assert not glob.glob(os.path.join(comfy, "models", "*", "*.part*")), "the demo left partial files among the models"
    run_dir, port = str(tmp_path / "tp2-run"), free_port()
    env["MASTER_PORT"] = str(free_port(0))  # the user's fixed port: a start right after `stop` must get it again
    launcher = os.path.join(pack, "scripts", "start-tp2.sh")
    # --base-dir: the copy links ComfyUI's code, whose folder_paths resolves its real folder; a real checkout needs none
    start = [launcher, "--base-dir", comfy, "--tp-size", "2", "--cpu", "--run-dir", run_dir, "--base-port", str(port), "--", "--disable-api-nodes"]  # fmt: skip
    first = subprocess.run(start, env=env, capture_output=True, text=True, timeout=300, cwd=pack)
    try:
        assert first.returncode == 0, first.stdout + first.stderr
        assert f"ComfyUI: {comfy} (the ComfyUI whose custom_nodes holds the pack)" in first.stdout, first.stdout
        assert f"Python: {venv_py} (ComfyUI's own venv)" in first.stdout, first.stdout
        submit = subprocess.run([os.path.join(pack, "scripts", "tp2-submit"), os.path.join(pack, "workflows", "api", "h3_tp2_tiny_demo.json"),
                                 "--run-dir", run_dir, "--out", str(tmp_path / "outputs")], env=env, capture_output=True, text=True,
                                cwd=pack, timeout=300)  # fmt: skip
        assert submit.returncode == 0, submit.stdout + submit.stderr
        assert submit.stdout.count(": identical") == 3 and "DIFFERENT" not in submit.stdout, submit.stdout
        stop = subprocess.run([launcher, "stop", "--run-dir", run_dir], env=env, capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        again = subprocess.run(start, env=env, capture_output=True, text=True, timeout=300, cwd=pack)  # at once, same ports
        assert again.returncode == 0, again.stdout + again.stderr
    finally:
        subprocess.run([launcher, "stop", "--run-dir", run_dir], env=env, capture_output=True, timeout=120)
    assert not os.path.exists(os.path.join(pack, ".venv")), "a second virtualenv was made for the pack"
    own = os.path.dirname(os.path.dirname(os.path.dirname(venv_py)))
    assert not glob.glob(os.path.join(own, "venv", "lib", "python*", "site-packages", "torch")), "torch was installed again"


def test_install_sh_uses_the_virtualenv_comfyui_runs_with(tmp_path):
    """scripts/install.sh --comfyui DIR, DIR a ComfyUI whose venv/ has torch: that virtualenv gets the pack's
    requirements (here already there) and keeps its torch; no .venv of the pack's own, nothing downloaded."""
    import time

    comfy = str(tmp_path / "ComfyUI")
    venv_py = _comfyui_with_its_own_venv(comfy)
    pack = str(tmp_path / "minimax-h3-tp2")
    subprocess.run(["git", "clone", "-q", ROOT, pack], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX", "COMFYUI_DIR", "TP2_VENV")}
    t0 = time.monotonic()
    res = subprocess.run(["bash", os.path.join(pack, "scripts", "install.sh"), "--comfyui", comfy, "--no-link"], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    took = time.monotonic() - t0
    print(f"\n[install.sh into ComfyUI's own virtualenv] {took:.0f} s")
    assert res.returncode == 0, res.stdout + res.stderr
    venv = os.path.dirname(os.path.dirname(venv_py))
    assert f"[install] using the Python your ComfyUI runs with ({venv})" in res.stdout, res.stdout
    assert ": your ComfyUI's, left as it is" in res.stdout and "[install] the pack's dependencies: already there" in res.stdout, res.stdout
    assert f"[install] python: {venv_py}" in res.stdout.splitlines(), res.stdout
    assert not os.path.exists(os.path.join(pack, ".venv")), "a second virtualenv was made for the pack"
    assert not glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "torch")), "torch was installed again"
