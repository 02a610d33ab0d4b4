"""Shared fixtures: synthetic H3 checkpoints made by scripts/make_tiny_h3.py (the same generator users run),
which ComfyUI the tests use (COMFYUI_DIR, by the scripts' own rule in scripts/lib/comfyui_dir.sh), and the time
bound of the launcher's tp_size refusal (used by the unit and the ComfyUI launcher tests)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "unit", "data")


def resolve_comfyui() -> tuple[str, str]:
    """(directory, where it came from): $COMFYUI_DIR, else the ComfyUI scripts/install.sh remembered in
    .comfyui-dir, else ~/ComfyUI; asked of scripts/lib/comfyui_dir.sh, so the tests and the scripts never differ."""
    lines = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "lib", "comfyui_dir.sh"), "--print"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return lines[0], lines[1]


COMFYUI_DIR, COMFYUI_FROM = resolve_comfyui()


def have_comfyui() -> bool:
    """A ComfyUI checkout with MiniMax-H3 at COMFYUI_DIR: the ComfyUI suite (tests/comfy) runs against it."""
    return all(os.path.isfile(os.path.join(COMFYUI_DIR, *p)) for p in (("main.py",), ("comfy", "ldm", "minimax", "model.py")))


def free_port(following: int = 3) -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it), with the `following` ports after it free too: a launcher
    given it as --base-port puts rank r on port + r, and refuses a taken one (as it should)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + following <= 65535 and all(_bindable(port + i) for i in range(1, following + 1)):
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def load_submit():
    """scripts/tp2-submit (a script without .py) as a module, for tests of its functions."""
    import importlib.machinery

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "tp2-submit")
    loader = importlib.machinery.SourceFileLoader("tp2_submit", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("tp2_submit", loader))
    loader.exec_module(module)
    return module


def slack() -> float:
    """How many times slower than idle this machine runs now: its run queue per core (the larger of the 1- and 5-minute
    load averages, over the cores), at least 1. A test's time limit is what an idle machine needs times this, so load
    alone cannot fail it (issue 49: on 2 cores under load 12 the fixed limits failed)."""
    return max(1.0, max(os.getloadavg()[:2]) / (os.cpu_count() or 1))


def assert_within(took: float, idle_limit: float, what: str) -> None:
    """`what` took less than `idle_limit` seconds, scaled by slack() as measured now (after the wait it limits)."""
    factor = slack()
    assert took < idle_limit * factor, f"{what} took {took:.1f} s: over {idle_limit:g} s x {factor:.1f} (load per core)"


def assert_refused_quickly(took: float) -> None:
    """The launcher refuses a tp_size within 5 s (issue 18), nearly all of it Python importing torch (tp2's checkpoint
    reader needs it). On a machine that other work slows down, the bound is that import, timed now, plus 1.5 s: a rank
    start or a second check would still fail it."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import tp2.plan"], cwd=ROOT, check=True, timeout=120)
    python_start = time.monotonic() - t0
    assert took < max(5.0, python_start + 1.5), f"the refusal took {took:.1f} s (importing tp2.plan alone: {python_start:.1f} s)"


def shard_state_dict(path: str, tp_size: int, tp_rank: int, shares=None):
    """Shard-on-read (no rank cache): this rank's state dict, the file's metadata and the plan."""
    from tp2.rank_cache import open_rank_shard

    shard = open_rank_shard(path, tp_rank, tp_size, shares=shares)
    return shard.state_dict, shard.metadata, shard.plan


def unshard_tensor(pieces: list, ts):
    """Inverse of tp2.shard.slice_tensor over all ranks (pieces in rank order)."""
    import torch

    if ts.kind == "split":
        per_part = [p.chunk(ts.parts, dim=ts.dim) for p in pieces]
        return torch.cat([chunks[i] for i in range(ts.parts) for chunks in per_part], dim=ts.dim)
    if ts.kind == "rank0":
        return torch.stack(pieces).sum(0).to(pieces[0].dtype)
    return pieces[0]


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_tiny_h3", os.path.join(ROOT, "scripts", "make_tiny_h3.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_tiny_h3 = _load_generator()


def make_checkpoint(path: str, *args: str) -> str:
    """Write a synthetic checkpoint with the generator's CLI arguments; returns the path."""
    assert make_tiny_h3.main([path, *args]) == 0
    return path


TINY_COND = "h3_tiny_cond.safetensors"


def make_models(folder: str, checkpoints: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Tiny checkpoints (file name -> generator arguments) and a 16-token conditioning file in `folder`, as the
    {models subfolder/name: path} map the ComfyUI harness links into each server's models folder."""
    out = {f"diffusion_models/{name}": make_checkpoint(os.path.join(folder, name), *args) for name, args in checkpoints.items()}
    make_tiny_h3.main(["--conditioning", os.path.join(folder, TINY_COND), "--text-dim", "128", "--tokens", "16"])
    out[f"h3_conditioning/{TINY_COND}"] = os.path.join(folder, TINY_COND)
    return out


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_float(tiny_dir):
    return make_checkpoint(os.path.join(tiny_dir, "h3_tiny_float.safetensors"))


@pytest.fixture(scope="session")
def tiny_float_full_adaln(tiny_dir):
    return make_checkpoint(os.path.join(tiny_dir, "h3_tiny_float_full.safetensors"), "--adaln", "full")


@pytest.fixture(scope="session")
def tiny_int8(tiny_dir):
    return make_checkpoint(os.path.join(tiny_dir, "h3_tiny_int8.safetensors"), "--int8")


@pytest.fixture(scope="session")
def tiny_float_wide(tiny_dir):
    """16 heads, FFN 2048: room for uneven shares at 4 ranks."""
    return make_checkpoint(os.path.join(tiny_dir, "h3_tiny_float_wide.safetensors"), "--heads", "16", "--ffn", "2048")


@pytest.fixture(scope="session")
def tiny_int8_wide(tiny_dir):
    """16 heads (8 ConvRot pairs), FFN 2048 (8 groups of 256): shares such as 3:1 and 5:1:1:1 cut whole groups."""
    return make_checkpoint(os.path.join(tiny_dir, "h3_tiny_int8_wide.safetensors"), "--int8", "--heads", "16", "--ffn", "2048")


def real_layout(name: str):
    from tp2.checkpoint import CheckpointLayout

    with open(os.path.join(DATA, name)) as f:
        doc = json.load(f)
    return CheckpointLayout({n: (d, tuple(s)) for n, (d, s) in doc["tensors"].items()}, doc["metadata"], doc["quant"], doc["source"])


@pytest.fixture(scope="session")
def h3_int8_layout():
    """The real MiniMax-H3 int8 ConvRot release layout (curve-form adaln): names, dtypes, shapes, quant markers."""
    return real_layout("h3_int8_convrot.layout.json")


@pytest.fixture(scope="session")
def h3_full_layout():
    """The real MiniMax-H3 full-form (bf16, time_embedder + 260 M-parameter adaln per block) layout."""
    return real_layout("h3_bf16_full.layout.json")


def pytest_terminal_summary(terminalreporter):
    """Say plainly whether the ComfyUI suite ran, against which checkout, and why any of it was skipped."""
    comfy_dir = f"{COMFYUI_DIR} ({COMFYUI_FROM})"
    ours = {
        o: [r for r in terminalreporter.stats.get(o, []) if "tests/comfy/" in getattr(r, "nodeid", "")]
        for o in ("passed", "failed", "skipped", "error")
    }
    counts = {o: len(rs) for o, rs in ours.items()}
    why = sorted({r.longrepr[2].removeprefix("Skipped: ") for r in ours["skipped"] if isinstance(r.longrepr, tuple)})
    ran = counts["passed"] + counts["failed"] + counts["error"]
    if not have_comfyui() and counts["skipped"]:
        line = f"ComfyUI suite: SKIPPED ({counts['skipped']} tests): no ComfyUI checkout at {comfy_dir}: set COMFYUI_DIR, or scripts/install.sh --comfyui DIR"
    elif ran or counts["skipped"]:
        line = f"ComfyUI suite: RAN {ran} tests against {comfy_dir} ({counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors"
        line += f", {counts['skipped']} skipped: {'; '.join(why)})" if counts["skipped"] else ")"
    else:
        line = "ComfyUI suite: not selected in this run"
    terminalreporter.write_line(line, bold=True)
