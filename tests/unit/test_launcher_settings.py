"""scripts/start-tp2.sh's checks, all made before any rank starts: the settings (the exact defaults, `--fast` for the
fastest measured ones, an environment variable winning over both; printed right after finding ComfyUI's main.py:
the stand-in ComfyUI folder has no custom_nodes, so it stops there with an error), the tp_size against the H3
checkpoints (`--ckpt NAME`, or every H3 file in models/diffusion_models), the GPU count without nvidia-smi, and
`status`/`stop`/`restart` leaving no run folder behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from slowed_balance import slowed_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(ROOT, "scripts", "start-tp2.sh")


def settings(tmp_path, *args, **env) -> dict[str, str]:
    res = _launch_until_settings(tmp_path, *args, **env)
    assert res.returncode != 0 and "no custom_nodes folder" in res.stderr, (res.stdout, res.stderr)
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("minimax-h3-tp2 settings:"))
    return dict(kv.split("=", 1) for kv in line.split(":", 1)[1].split())


@pytest.mark.parametrize(
    "args,env,expected",
    [
        ((), {}, {"TP2_REDUCE_DTYPE": "fp32", "TP2_SEQUENCE_PARALLEL": "0", "TP2_SP_FUSED_NORM": "0", "TP2_SP_INT8_GATHER": "1"}),
        (("--fast",), {}, {"TP2_REDUCE_DTYPE": "bf16", "TP2_SEQUENCE_PARALLEL": "1", "TP2_SP_FUSED_NORM": "1", "TP2_SP_INT8_GATHER": "1"}),
        (("--fast",), {"TP2_REDUCE_DTYPE": "fp32"}, {"TP2_REDUCE_DTYPE": "fp32", "TP2_SEQUENCE_PARALLEL": "1", "TP2_SP_FUSED_NORM": "1"}),
        (("--", "--fast"), {}, {"TP2_REDUCE_DTYPE": "fp32", "TP2_SEQUENCE_PARALLEL": "0"}),  # after --: ComfyUI's argument
    ],
    ids=["defaults", "fast", "env_wins", "after_double_dash"],
)
def test_launcher_settings(tmp_path, args, env, expected):
    got = settings(tmp_path, *args, **env)
    assert {k: got[k] for k in expected} == expected, got


@pytest.mark.parametrize(
    "extra,says",
    [
        (("--listen", "0.0.0.0"), "'--listen' after -- is ComfyUI's --listen, which the launcher owns"),
        (("--listen=0.0.0.0",), "'--listen=0.0.0.0' after -- is ComfyUI's --listen"),
        (("--liste", "0.0.0.0"), "'--liste' after -- is ComfyUI's --listen"),  # argparse takes abbreviations
        (("--lis", "::"), "'--lis' after -- is ComfyUI's --listen"),
        (("--port=9000",), "'--port=9000' after -- is ComfyUI's --port, which the launcher owns: use start-tp2.sh --base-port N"),
        (("--po", "9000"), "'--po' after -- is ComfyUI's --port"),
    ],
)
def test_launcher_owns_listen_and_port(tmp_path, extra, says):
    comfy = tmp_path / "ComfyUI"
    comfy.mkdir()
    (comfy / "main.py").write_text("")
    res = subprocess.run(
        ["bash", LAUNCHER, "--comfyui", str(comfy), "--cpu", "--run-dir", str(tmp_path / "run"), "--", *extra],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode != 0 and says in res.stderr, res.stderr


def _path_without(program: str) -> str:
    return os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not os.path.exists(os.path.join(d, program)))


def _comfyui_with_pack(tmp_path, checkpoints=()):
    """A stand-in ComfyUI (empty main.py) with this pack linked in and tiny checkpoints in models/diffusion_models."""
    from conftest import make_checkpoint

    comfy = tmp_path / "ComfyUI"
    (comfy / "custom_nodes").mkdir(parents=True)
    (comfy / "main.py").write_text("")
    os.symlink(ROOT, comfy / "custom_nodes" / "minimax-h3-tp2")
    (comfy / "models" / "diffusion_models").mkdir(parents=True)
    for name, args in checkpoints:
        make_checkpoint(str(comfy / "models" / "diffusion_models" / name), *args)
    return comfy


def _launch(tmp_path, comfy, *args, path=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TP2_")}
    env = clean | {"PYTHON": sys.executable} | ({"PATH": path} if path else {})
    t0 = time.monotonic()
    res = subprocess.run(["bash", LAUNCHER, "--comfyui", str(comfy), "--run-dir", str(tmp_path / "run"), *args],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    return res, time.monotonic() - t0


def test_no_nvidia_smi_is_a_clean_refusal(tmp_path):
    """Without --cpu on a machine without nvidia-smi: the hint, not a bash error first."""
    res, _ = _launch(tmp_path, _comfyui_with_pack(tmp_path), "--tp-size", "2", path=_path_without("nvidia-smi"))
    assert res.returncode == 1
    assert res.stderr == (
        "start-tp2: tp_size 2 needs 2 GPUs, and there is no nvidia-smi here (no NVIDIA driver?): use --gpus LIST, "
        "or --cpu for a CPU test run\n"
    ), res.stderr


def test_tp_size_the_checkpoint_cannot_split_is_refused_before_any_rank(tmp_path):
    """The tiny int8 model (4 heads, 256-column ConvRot groups) splits 1 or 2 ways; 3 is refused by the scan of
    models/diffusion_models, within 5 s (conftest.assert_refused_quickly), and no rank was started: no pids file, no
    rank log. A non-H3 file next to it is not judged."""
    comfy = _comfyui_with_pack(tmp_path, [("h3_tiny_int8.safetensors", ("--int8",))])
    (comfy / "models" / "diffusion_models" / "other_model.safetensors").write_bytes(b"\0" * 64)
    res, took = _launch(tmp_path, comfy, "--cpu", "--tp-size", "3")
    assert res.returncode == 1, res.stdout + res.stderr
    assert (
        "h3_tiny_int8.safetensors: Cannot split 'blocks.*.attn.qkv_proj' heads (4) across tp_size=3: not divisible. Use tp_size 1 or 2."
        in res.stderr
    )
    assert "tp_size 3 refused before starting any rank" in res.stderr and "other_model" not in res.stderr, res.stderr
    from conftest import assert_refused_quickly

    assert_refused_quickly(took)
    assert not (tmp_path / "run" / "pids").exists() and not list((tmp_path / "run").glob("rank*")), os.listdir(tmp_path / "run")


def test_tp_size_check_passes_a_size_that_fits_and_names_the_file(tmp_path):
    """tp_size 2 fits: the launcher goes on to the next check (here: no GPUs, no nvidia-smi on PATH)."""
    comfy = _comfyui_with_pack(tmp_path, [("h3_tiny_int8.safetensors", ("--int8",))])
    res, _ = _launch(tmp_path, comfy, "--tp-size", "2", path=_path_without("nvidia-smi"))
    assert "tp_size 2: fits h3_tiny_int8.safetensors" in res.stdout, res.stdout + res.stderr
    assert res.returncode == 1 and "there is no nvidia-smi here" in res.stderr, res.stderr


@pytest.mark.parametrize(
    "ckpt,says",
    [
        ("missing.safetensors", "--ckpt missing.safetensors: no such file, nor in"),
        ("other_model.safetensors", "other_model.safetensors: '"),  # named explicitly: a file that is no H3 model is refused
        ("h3_tiny_int8.safetensors", "Use tp_size 1 or 2."),
    ],
    ids=["missing", "not_h3", "cannot_split"],
)
def test_ckpt_names_the_file_to_check(tmp_path, ckpt, says):
    comfy = _comfyui_with_pack(tmp_path, [("h3_tiny_int8.safetensors", ("--int8",))])
    (comfy / "models" / "diffusion_models" / "other_model.safetensors").write_bytes(b"\0" * 64)
    res, _ = _launch(tmp_path, comfy, "--cpu", "--tp-size", "3", "--ckpt", ckpt)
    assert res.returncode == 1 and says in res.stderr, res.stderr
    assert not (tmp_path / "run" / "pids").exists()


@pytest.mark.parametrize("cmd,rc,says", [("status", 1, "no run folder"), ("stop", 0, "nothing to stop"), ("restart", 1, "no run folder")])
def test_status_stop_restart_do_not_make_a_run_dir(tmp_path, cmd, rc, says):
    quiet = tmp_path / "bin"  # a `ps` that sees no ranks: this machine may run sets of its own (the next test has them)
    quiet.mkdir()
    (quiet / "ps").write_text("#!/bin/sh\nexit 0\n")
    (quiet / "ps").chmod(0o755)
    env = dict(os.environ, PATH=f"{quiet}{os.pathsep}{os.environ['PATH']}")
    res = subprocess.run(["bash", LAUNCHER, cmd, "--rank", "0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == rc and says in res.stdout + res.stderr, res.stdout + res.stderr
    assert not (tmp_path / "tp2-run").exists()


def _launch_until_settings(tmp_path, *args, **env):
    comfy = tmp_path / "ComfyUI"
    comfy.mkdir(exist_ok=True)
    (comfy / "main.py").write_text("")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TP2_", "PYTORCH_CUDA_ALLOC_CONF"))}
    return subprocess.run(
        ["bash", LAUNCHER, "--comfyui", str(comfy), "--cpu", "--run-dir", str(tmp_path / "run"), *args],
        env=clean | env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_lean_memory_switches_to_torchs_native_allocator_without_expandable_segments(tmp_path):
    default = _launch_until_settings(tmp_path)
    assert "minimax-h3-tp2 CUDA allocator: ComfyUI's (cudaMallocAsync where it chooses it)" in default.stdout, default.stdout
    lean = _launch_until_settings(tmp_path, "--lean-memory")
    assert "minimax-h3-tp2 CUDA allocator: torch's native\n" in lean.stdout, lean.stdout  # nothing added to the conf
    lean = _launch_until_settings(tmp_path, "--lean-memory", PYTORCH_CUDA_ALLOC_CONF="garbage_collection_threshold:0.8")
    says = "minimax-h3-tp2 CUDA allocator: torch's native, PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.8\n"
    assert says in lean.stdout, lean.stdout


@pytest.mark.parametrize("flag", ["--lean-memory", "--pin-weights"])
def test_the_native_allocators_flags_refuse_a_conf_that_asks_for_cudamallocasync(tmp_path, flag):
    res = _launch_until_settings(tmp_path, flag, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    says = f"{flag} uses torch's native allocator, but PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync asks for cudaMallocAsync"
    assert res.returncode != 0 and says in res.stderr, res.stderr


def test_a_port_already_taken_is_refused_before_any_rank(tmp_path):
    """Rank 1's port is held by another program: refused within seconds, naming the port and --base-port, with no
    rank started (ComfyUI would find it only after its start-up, and advise a --port the launcher refuses)."""
    import socket

    from conftest import assert_refused_quickly, free_port

    base = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", base + 1))
        held.listen(1)
        res, took = _launch(tmp_path, _comfyui_with_pack(tmp_path), "--cpu", "--tp-size", "2", "--base-port", str(base))
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"port {base + 1} (rank 1) is in use on 127.0.0.1" in res.stderr and "--base-port N" in res.stderr, res.stderr
    assert_refused_quickly(took)
    assert not (tmp_path / "run" / "pids").exists()


@pytest.mark.parametrize("cmd", ["stop", "status"])
def test_stop_or_status_where_no_run_is_says_where_ranks_run(tmp_path, cmd):
    """`stop` in a folder with no run exited 0 while ranks ran elsewhere: now it names their run folder (from the
    ranks' command lines) and the command for it, and exits 1."""
    elsewhere = tmp_path / "elsewhere" / "tp2-run"
    out_dir = elsewhere / "rank0" / "output"
    fake_rank = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "--output-directory", str(out_dir), "--temp-directory", "x"]
    )
    try:
        deadline = time.monotonic() + 10
        while b"--output-directory" not in open(f"/proc/{fake_rank.pid}/cmdline", "rb").read() and time.monotonic() < deadline:
            time.sleep(0.05)  # until the fork has become the fake rank
        here = tmp_path / "here"
        here.mkdir()
        res = subprocess.run(["bash", LAUNCHER, cmd], cwd=here, capture_output=True, text=True, timeout=60)
    finally:
        fake_rank.kill()
        fake_rank.wait()
    assert res.returncode == 1, res.stdout + res.stderr
    assert "ranks are running from:" in res.stderr and f"{elsewhere}   (" in res.stderr and f"{cmd} --run-dir {elsewhere}" in res.stderr, (
        res.stderr
    )


def _h3_comfyui_with_pack(tmp_path):
    comfy = _comfyui_with_pack(tmp_path)
    (comfy / "comfy" / "ldm" / "minimax").mkdir(parents=True)
    (comfy / "comfy" / "ldm" / "minimax" / "model.py").write_text("")
    return comfy


def test_a_python_without_the_packs_requirements_is_refused_naming_them(tmp_path):
    """PYTHON without torch or comfy-kitchen (a bare virtualenv): refused within seconds, before any rank starts,
    naming what is missing and the pip command that installs it into that Python."""
    from conftest import assert_refused_quickly, free_port

    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=60)
    comfy = _h3_comfyui_with_pack(tmp_path)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TP2_", "VIRTUAL_ENV", "CONDA_PREFIX"))}
    t0 = time.monotonic()
    res = subprocess.run(
        ["bash", LAUNCHER, "--comfyui", str(comfy), "--cpu", "--run-dir", str(tmp_path / "run"), "--base-port", str(free_port()),
         "--python", str(bare / "bin" / "python")],
        env=clean, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"Python: {bare}/bin/python (--python)" in res.stdout, res.stdout
    assert "(--python) lacks torch, safetensors, numpy, aiohttp, comfy_kitchen" in res.stderr, res.stderr
    assert f"-m pip install -r {ROOT}/requirements.txt" in res.stderr, res.stderr
    assert_refused_quickly(time.monotonic() - t0)
    assert not (tmp_path / "run" / "pids").exists()


def test_a_comfyui_without_h3_is_refused_before_any_rank(tmp_path):
    from conftest import free_port

    res, took = _launch(tmp_path, _comfyui_with_pack(tmp_path), "--cpu", "--base-port", str(free_port()))
    assert res.returncode == 1 and "has no MiniMax-H3 support (comfy/ldm/minimax/model.py): update ComfyUI" in res.stderr, res.stderr
    assert not (tmp_path / "run" / "pids").exists()


def test_the_python_comfyui_runs_with_comes_before_the_packs_own(tmp_path):
    """A ComfyUI with its own venv/ (the usual manual install): the ranks run under it, and the launcher says so."""
    from conftest import free_port

    comfy = _h3_comfyui_with_pack(tmp_path)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(comfy / "venv")], check=True, timeout=60)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TP2_", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHON"))}
    res = subprocess.run(
        ["bash", LAUNCHER, "--comfyui", str(comfy), "--cpu", "--run-dir", str(tmp_path / "run"), "--base-port", str(free_port())],
        env=clean, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert f"Python: {comfy}/venv/bin/python (ComfyUI's own venv)" in res.stdout, res.stdout + res.stderr
    assert res.returncode == 1 and "(ComfyUI's own venv) lacks torch" in res.stderr, res.stderr  # a bare venv, here


def test_native_windows_is_refused_at_once_with_the_wsl2_pointer(tmp_path):
    """Git Bash on Windows runs bash scripts: the launcher says at once that the pack needs Linux (or WSL2)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "uname").write_text("#!/bin/sh\necho MINGW64_NT-10.0-19045\n")
    (fake / "uname").chmod(0o755)
    res, took = _launch(tmp_path, _comfyui_with_pack(tmp_path), "--cpu", path=f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert res.returncode == 1 and "native Windows is not supported" in res.stderr and "WSL2" in res.stderr, res.stderr
    assert took < 10


@pytest.mark.parametrize("args", [("--split", "--cpu"), ("--cpu", "--split"), ("--ckpt", "--split", "3:1")])
def test_an_option_without_its_value_is_refused(tmp_path, args):
    """`--split --cpu` took --cpu as the split before (issue 39): an option that takes a value refuses a missing one."""
    res, _ = _launch(tmp_path, _comfyui_with_pack(tmp_path), *args)
    assert (
        res.returncode == 1 and res.stderr == f"start-tp2: {args[0] if args[0] != '--cpu' else '--split'} needs a value (see --help)\n"
    ), res.stderr


def test_a_split_with_fewer_units_than_ranks_is_refused_fast(tmp_path):
    """8 heads of 32 in 256-wide ConvRot groups are one unit: 3:1 cannot give rank 1 one. tp2.split.workable moved
    that unit back and forth for ever (issue 39); now the launcher refuses it, naming the width, before any rank."""
    comfy = _comfyui_with_pack(tmp_path, [("h8.safetensors", ("--int8", "--heads", "8", "--head-dim", "32"))])
    res, took = _launch(tmp_path, comfy, "--cpu", "--split", "3:1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "h8.safetensors: The split 3:1 leaves a rank no whole unit of the DiT's heads (8 = 1 units of 8)" in res.stderr
    assert "No uneven split of 2 ranks can" in res.stderr and "refused before starting any rank" in res.stderr, res.stderr
    from conftest import assert_refused_quickly

    assert_refused_quickly(took)


def test_a_check_that_does_not_end_names_its_file(tmp_path):
    """A file whose read blocks (a FIFO with no writer, as a stalled mount would) is named once the check's watchdog
    expires (CHECK_TIMEOUT_S, shortened here), and the check ends with 3, which the launcher refuses."""
    fifo = tmp_path / "stalled.safetensors"
    os.mkfifo(fifo)
    code = "import sys, check_tp_size as c; c.CHECK_TIMEOUT_S = 1.0; sys.exit(c.main(['2', '', '1', sys.argv[1]]))"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.path.join(ROOT, 'scripts', 'lib')}")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code, str(fifo)], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 3 and f"checking {fifo} took more than 1 s: stopped" in res.stderr, res.stderr
    assert time.monotonic() - t0 < 30
    assert "3) die " in open(LAUNCHER).read()  # the launcher's refusal of exit 3


def test_check_on_the_cpu_answers_in_seconds_without_comfyui_or_model_files(tmp_path):
    """`start-tp2.sh check --cpu`: no ComfyUI started (a stand-in folder, no custom_nodes, no models), no run folder;
    each rank's block at its share, the link from a real gloo all-reduce between two processes, the capacity table,
    and the speed-up. Rank 1 slowed threefold (tests/slowed_balance.py as $PYTHON): the even split runs at its pace, under the
    fastest card alone, and the output says plainly that TP buys memory there; --split auto's 3:1 predicts more."""
    comfy = tmp_path / "ComfyUI"
    comfy.mkdir()
    (comfy / "main.py").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TP2_")} | {"PYTHON": slowed_python(tmp_path, "1,3")}
    t0 = time.monotonic()
    res = subprocess.run(["bash", LAUNCHER, "check", "--comfyui", str(comfy), "--cpu", "--run-dir", str(tmp_path / "run")],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert took < 60, f"check took {took:.0f} s: seconds, not minutes"
    assert "rank 0: CPU" in out and "rank 1: CPU" in out and "compute dtype fp32" in out and "fp32 compute" in out, out
    link = next(ln for ln in out.splitlines() if ln.startswith("link: "))
    assert "(gloo, host memory; one 8 MiB all-reduce in" in link and float(link.split()[1]) > 0, link
    assert "1920x1088: resident (--highvram) 90 (3.8 s), streamed (dynamic VRAM) 141 (5.9 s)" in out, out  # fp32, the CPU's
    even = next(ln for ln in out.splitlines() if ln.startswith("even: predicted "))
    auto = next(ln for ln in out.splitlines() if ln.startswith("--split auto: predicted "))
    assert "TP buys memory here, not speed" in even and float(even.split()[2].rstrip("x")) < 0.8, even
    a, b = map(int, re.search(r" at (\d+):(\d+)", auto).groups())
    assert 2 <= a / b <= 4.5 and float(auto.split()[3].rstrip("x")) > float(even.split()[2].rstrip("x")), auto  # ~3:1 on a busy CPU
    assert "TP2_BLOCK_MS=" in out and not (tmp_path / "run").exists() and "starting" not in out
    wires = next(ln for ln in out.splitlines() if ln.startswith("wires (TP2_WIRE; a model, no overlap): "))
    exact, int8 = (float(re.search(rf"{w} ([\d.]+)x", wires).group(1)) for w in ("exact", "int8"))
    assert int8 >= exact and wires.split("picked: ")[1].startswith("int8" if int8 >= 1.1 * exact else "exact"), wires  # the model's pick
    assert f"(wire {wires.split('picked: ')[1].split()[0]}: collectives" in even, even
    host = next(ln for ln in out.splitlines() if ln.startswith("host memory: "))
    available = float(host.split()[2])
    assert 0 < available <= float(host.split()[6].rstrip(";")), host  # this machine's, as /proc/meminfo has it
    for size in ("832x480x124: 2 x 4.3 = 8.6 GiB (2 x 25.7 with --pin-weights): ", "1920x1088x124: 2 x 10.1 = 20.2 GiB"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(size))
        assert line.split("): ")[1].startswith(("fits", "will not fit: the kernel's out-of-memory killer")), line


def test_gpus_given_where_there_is_no_gpu_names_that_cause(tmp_path):
    """--gpus 0,1 on a machine without a GPU (no nvidia-smi, torch sees none): the cause, not "install the requirements"."""
    from conftest import free_port

    res, _ = _launch(tmp_path, _h3_comfyui_with_pack(tmp_path), "--gpus", "0,1", "--base-port", str(free_port()),
                     path=_path_without("nvidia-smi"))  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    assert "--gpus 0,1: there is no GPU here (no nvidia-smi: no NVIDIA driver); use --cpu" in res.stderr, res.stderr
    assert "pip install" not in res.stderr


def test_check_host_memory_verdicts_follow_the_measured_figures():
    """check's host memory lines: a 125 GiB host fits the pair, with --pin-weights too; 50 GiB fits the launcher's ranks
    but not ComfyUI's pinned copies; 12 GiB cannot hold even the ranks' own memory."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "lib"))
    import check

    verdicts = {a: [ln.split("): ", 1)[1] for ln in check.host_lines(2, a, 125.0)[1:]] for a in (125.0, 50.0, 12.0)}
    assert verdicts[125.0] == ["fits, with --pin-weights too"] * 2, verdicts
    assert all(v.startswith("fits; with --pin-weights ComfyUI would drop") for v in verdicts[50.0]), verdicts
    assert all(v.startswith("will not fit") for v in verdicts[12.0]), verdicts
    assert check.rank_host_gib(832, 480, 124, 2) == (4.3, 25.7)  # docs/PERFORMANCE.md's measured figures
    assert check.rank_host_gib(832, 480, 124, 4)[1] < 25.7  # pins scale with the share


@pytest.mark.parametrize("split", ["3", "3;2", "3:0", "3:2:1"])
def test_a_split_that_is_no_split_is_refused_before_torch_loads_and_blames_no_model(tmp_path, split):
    """A --split typo (issue 49: '3' cost a torch import, 7-9 s, then a line saying the model cannot be split that
    way): one line saying the form, and sooner than Python imports torch alone (timed now, so load slows both)."""
    comfy = _comfyui_with_pack(tmp_path, [("h3_tiny_int8.safetensors", ("--int8",))])
    res, took = _launch(tmp_path, comfy, "--cpu", "--split", split)
    assert res.returncode == 1 and res.stderr == (
        f"start-tp2: split '{split}' is not 2 positive whole numbers joined by ':' (one per rank, rank 0 first), e.g. 3:2; "
        "leave it out for an even split.\n"
    ), res.stderr
    assert "tp_size" not in res.stdout and not (tmp_path / "run" / "pids").exists(), res.stdout
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120)
    assert took < time.monotonic() - t0, took


FAKE_SMI = """#!/bin/sh
case "$*" in
  "-L") printf 'GPU 0: NVIDIA GeForce RTX 4090 (UUID: GPU-a)\\nGPU 1: NVIDIA GeForce RTX 3090 (UUID: GPU-b)\\n' ;;
  "topo -m") cat "$FAKE_TOPO_M" ;;
  "topo -p2p r") cat "$FAKE_TOPO_P2P" ;;
  *compute_cap*) printf '8.9\\n8.6\\n' ;;
  *) exit 1 ;;
esac
"""


@pytest.mark.parametrize(
    "p2p,env,says",
    [
        ("no", {}, "link: through host memory (PCIe without peer-to-peer); set for it: TP2_WIRE=int8 NCCL_SHM_USE_CUDA_MEMCPY=1 (the wire"),
        ("no", {"NCCL_SHM_USE_CUDA_MEMCPY": "0", "TP2_WIRE": "exact"}, "TP2_WIRE=exact (yours) NCCL_SHM_USE_CUDA_MEMCPY=0 (yours) (the"),
        ("ok", {}, "link: PCIe peer-to-peer (PHB); set for it: TP2_WIRE=int8 (the wire by the link's kind"),
    ],
    ids=["host_memory", "yours_wins", "p2p"],
)
def test_the_launcher_sets_the_wire_and_nccl_for_the_link_and_your_value_wins(tmp_path, p2p, env, says):
    """Two GPUs as nvidia-smi describes them (a stand-in on PATH: this machine has none): through PCIe the launcher
    exports the compressed wire, over host memory also the published NCCL setting for such links, before any rank
    starts, says so, and keeps a value you set. The stand-in ComfyUI has no H3, so the start stops at the Python check after that."""
    from test_link import MATRIX_PCIE, P2P_NO, P2P_OK

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    (tmp_path / "m").write_text(MATRIX_PCIE)
    (tmp_path / "p").write_text(P2P_NO if p2p == "no" else P2P_OK)
    comfy = _comfyui_with_pack(tmp_path, [("h3_tiny_int8.safetensors", ("--int8",))])
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TP2_", "NCCL_"))}
    run_env = clean | env | {"PYTHON": sys.executable, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                             "FAKE_TOPO_M": str(tmp_path / "m"), "FAKE_TOPO_P2P": str(tmp_path / "p")}  # fmt: skip
    res = subprocess.run(["bash", LAUNCHER, "--comfyui", str(comfy), "--run-dir", str(tmp_path / "run"), "--tp-size", "2"],
                         env=run_env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert says in res.stdout, res.stdout + res.stderr
    assert says in (tmp_path / "run" / "link").read_text()  # what `status` shows
    assert res.returncode == 1 and not list((tmp_path / "run").glob("rank*")), res.stderr  # the stand-in ComfyUI: no rank started


@pytest.mark.parametrize(
    "args,says",
    [
        ((), "off (ComfyUI's --disable-pinned-memory; --pin-weights keeps them)"),
        (("--pin-weights",), "on (--pin-weights: each rank holds a page-locked copy of its weights)"),
        (("--pin-weights", "--", "--disable-pinned-memory"), "off (ComfyUI's --disable-pinned-memory"),  # yours, after --
    ],
    ids=["default_off", "pin_weights", "yours_after_double_dash"],
)
def test_the_ranks_start_without_pinned_weight_copies_unless_asked(tmp_path, args, says):
    """The launcher's default (measured on one H100, docs/PERFORMANCE.md: 3.0 instead of 24.5 GiB of private host memory a
    rank, the warm prompt 2% slower, and 1920x1088x124 runs on 22 GiB cards where the pinned copies ran out)."""
    res = _launch_until_settings(tmp_path, *args)
    assert f"minimax-h3-tp2 pinned weight copies: {says}" in res.stdout, res.stdout + res.stderr
    native = "minimax-h3-tp2 CUDA allocator: torch's native (--pin-weights: with pinned copies cudaMallocAsync's pool ran out"
    assert (native in res.stdout) == ("--pin-weights" in args), res.stdout  # the copies come with the allocator that retries
