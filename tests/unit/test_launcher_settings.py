"""scripts/start-tp2.sh's settings, read before any rank starts: the exact defaults, `--fast` for the fastest measured
ones, and an environment variable winning over both. The launcher prints its settings right after finding
ComfyUI's main.py; the stand-in ComfyUI folder here has no custom_nodes, so it stops there with an error."""

from __future__ import annotations

import os
import subprocess

import pytest

LAUNCHER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "start-tp2.sh")


def settings(tmp_path, *args, **env) -> dict[str, str]:
    comfy = tmp_path / "ComfyUI"
    comfy.mkdir(exist_ok=True)
    (comfy / "main.py").write_text("")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TP2_")}
    res = subprocess.run(
        ["bash", LAUNCHER, "--comfyui", str(comfy), "--cpu", "--run-dir", str(tmp_path / "run"), *args],
        env=clean | env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
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
    "extra,says", [(("--listen", "0.0.0.0"), "'--listen' after -- is not allowed"), (("--port=9000",), "'--port' after --")]
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
