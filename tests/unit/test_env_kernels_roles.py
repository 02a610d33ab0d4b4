"""TP env parsing, int8 kernel selection, the role guard, and the rule that tp2/ never imports comfy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_env_parsing():
    from tp2.errors import TP2Error
    from tp2.settings import read_tp_env

    assert read_tp_env({}) is None
    env = read_tp_env({"TP2_RANK": "1", "TP2_WORLD_SIZE": "2", "MASTER_PORT": "29600", "TP2_TIMEOUT_S": "30"})
    assert (env.tp_rank, env.tp_size, env.master_addr, env.master_port, env.timeout_s) == (1, 2, "127.0.0.1", 29600, 30.0)
    with pytest.raises(TP2Error, match=r"TP2_WORLD_SIZE is not set but the other TP variable is"):
        read_tp_env({"TP2_RANK": "0"})
    with pytest.raises(TP2Error, match=r"TP2_RANK=2 must be in 0\.\.1 for TP2_WORLD_SIZE=2"):
        read_tp_env({"TP2_RANK": "2", "TP2_WORLD_SIZE": "2"})
    with pytest.raises(TP2Error, match=r"TP2_RANK='zero' must be a whole number"):
        read_tp_env({"TP2_RANK": "zero", "TP2_WORLD_SIZE": "2"})


def test_forced_kernel_that_cannot_run_here_is_refused():
    from kernels import KernelUnavailableError, select_int8_gemm

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the refusal is for CPU-only machines")
    with pytest.raises(KernelUnavailableError, match=r"TP2_INT8_KERNEL=cuda cannot run on this machine: CUDA not available"):
        select_int8_gemm("cuda")


@pytest.mark.parametrize("name", ["auto", "eager"])
def test_selected_kernel_runs_int8_convrot(name):
    from comfy_kitchen.tensor import QuantizedTensor

    from kernels import select_int8_gemm

    w = torch.randn(64, 512) / 512**0.5
    sd = QuantizedTensor.from_float(
        w, "TensorWiseINT8Layout", is_weight=True, per_channel=True, convrot=True, convrot_groupsize=256
    ).state_dict("w")
    x = torch.randn(8, 512)
    y = select_int8_gemm(name)(x, sd["w"], sd["w_scale"], None, torch.float32, 256, None)
    err = float((y - x @ w.T).norm() / (x @ w.T).norm())
    assert y.dtype == torch.float32 and err < 0.03, err


def test_linear_without_role_is_refused():
    from tp2.errors import MissingRoleError
    from tp2.layers import require_role

    with pytest.raises(
        MissingRoleError, match=r"Linear 'blocks\.3\.mlp\.fc2' ran inside a tensor-parallel model without a TP role \(tp_role=None\)"
    ):
        require_role(torch.nn.Linear(4, 4), "blocks.3.mlp.fc2")
    tagged = torch.nn.Linear(2, 2)
    tagged.tp_role = "colwise"
    assert require_role(tagged, "x") == "colwise"


def test_tp2_never_imports_comfy():
    """Import every tp2 module with any `comfy*` import made to fail; none may need it or pull it in."""
    code = """
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "comfy" or name.startswith(("comfy.", "comfy_api", "comfy_extras")):
            raise ImportError("tp2 must not import " + name)
sys.meta_path.insert(0, Block())
import tp2
for m in pkgutil.walk_packages(tp2.__path__, "tp2."):
    importlib.import_module(m.name)
bad = [m for m in sys.modules if m == "comfy" or m.startswith(("comfy.", "comfy_api", "comfy_extras"))]
assert not bad, bad
print(len([m for m in sys.modules if m.startswith("tp2")]))
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.strip()) >= 9
