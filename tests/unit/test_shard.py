"""Slicing round trips for every style, shard-on-read vs in-memory slicing, the file fingerprint, the inspect CLI and
the record of checked files."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import shard_state_dict, unshard_tensor
from safetensors.torch import load_file, save_file

from tp2.checkpoint import CheckpointLayout
from tp2.plan import RANK0, SPLIT, WHOLE, TensorShard, resolve_plan
from tp2.rank_cache import verified_before
from tp2.safetensors_io import TensorReader, file_fingerprint, read_header
from tp2.shard import slice_tensor
from tp2.split import cut

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STYLES = [
    ("colwise", TensorShard("w", SPLIT, 0, 1, (24, 8), "F32", "colwise")),
    ("colwise_packed qkv", TensorShard("w", SPLIT, 0, 3, (48, 8), "F32", "colwise_packed")),
    ("colwise_packed gate|up", TensorShard("w", SPLIT, 0, 2, (32, 8), "F32", "colwise_packed")),
    ("packed scale [N,1]", TensorShard("s", SPLIT, 0, 3, (48, 1), "F32", "colwise_packed")),
    ("rowwise", TensorShard("w", SPLIT, 1, 1, (8, 32), "F32", "rowwise")),
    ("rowwise bias on rank 0", TensorShard("b", RANK0, None, 1, (8,), "F32", "rowwise")),
    ("replicated", TensorShard("n", WHOLE, None, 1, (8,), "F32", "replicate")),
]


@pytest.mark.parametrize("shares", [(1,), (1, 1), (1, 1, 1, 1), (3, 1), (1, 2, 1)], ids=str)
@pytest.mark.parametrize("label,ts", STYLES, ids=[s[0] for s in STYLES])
def test_slice_unshard_round_trip_is_exact(label, ts, shares):
    if ts.kind == SPLIT:
        ts = dataclasses.replace(ts, bounds=cut(ts.full_shape[ts.dim] // ts.parts, 1, shares))
    full = torch.randn(ts.full_shape)
    pieces = [slice_tensor(full, ts, r) for r in range(len(shares))]
    assert [tuple(p.shape) for p in pieces] == [ts.local_shape(r) for r in range(len(shares))]
    assert torch.equal(unshard_tensor(pieces, ts), full)
    if ts.kind == RANK0 and len(shares) > 1:
        assert all(not p.any() for p in pieces[1:]), "only rank 0 may hold a row-parallel bias"


def test_packed_slices_take_each_part():
    # rows 0..5 = q, 6..11 = k, 12..17 = v; rank 1 of 2 must hold q[3:6], k[3:6], v[3:6]; at 2:1 rank 1 holds 2 of 6
    ts = TensorShard("qkv", SPLIT, 0, 3, (18, 1), "F32", "colwise_packed", (0, 3, 6))
    full = torch.arange(18.0).view(18, 1)
    assert slice_tensor(full, ts, 1).flatten().tolist() == [3, 4, 5, 9, 10, 11, 15, 16, 17]
    uneven = dataclasses.replace(ts, bounds=(0, 4, 6))
    assert slice_tensor(full, uneven, 1).flatten().tolist() == [4, 5, 10, 11, 16, 17]


@pytest.mark.parametrize(
    "fixture,shares",
    [
        ("tiny_float", (1, 1)),
        ("tiny_float", (1, 1, 1, 1)),
        ("tiny_float_full_adaln", (1, 1)),
        ("tiny_int8", (1, 1)),
        ("tiny_float", (3, 1)),
        ("tiny_float_full_adaln", (1, 3)),
    ],
)
def test_shard_on_read_equals_slicing_the_full_file(request, fixture, shares):
    path = request.getfixturevalue(fixture)
    full = load_file(path)
    pieces = {}
    for r in range(len(shares)):
        sd, md, plan = shard_state_dict(path, len(shares), r, shares)
        assert set(sd) == set(full)
        for name, t in sd.items():
            ts = plan.tensors[name]
            assert tuple(t.shape) == ts.local_shape(r) and t.dtype == full[name].dtype, name
            assert torch.equal(t, slice_tensor(full[name], ts, r)), name
            pieces.setdefault(name, []).append(t)
    for name, ps in pieces.items():
        assert torch.equal(unshard_tensor(ps, plan.tensors[name]), full[name]), name


def test_reader_reads_columns_in_chunks(tmp_path, monkeypatch):
    import tp2.safetensors_io as io

    t = torch.randn(37, 24).to(torch.bfloat16)
    save_file({"t": t}, str(tmp_path / "t.safetensors"))
    monkeypatch.setattr(io, "READ_CHUNK_BYTES", 100)  # 2 rows per chunk
    with TensorReader(str(tmp_path / "t.safetensors")) as r:
        assert torch.equal(r.read_cols("t", 5, 17, torch.empty(37, 12, dtype=t.dtype)), t[:, 5:17])
        assert torch.equal(r.read_rows("t", 3, 9, torch.empty(6, 24, dtype=t.dtype)), t[3:9])


def test_fingerprint_sees_different_weights_with_the_same_layout(tiny_dir):
    from conftest import make_checkpoint

    a = make_checkpoint(os.path.join(tiny_dir, "seed1.safetensors"), "--seed", "1")
    b = make_checkpoint(os.path.join(tiny_dir, "seed2.safetensors"), "--seed", "2")
    ha, hb = read_header(a), read_header(b)
    assert ha.header_bytes == hb.header_bytes
    assert file_fingerprint(ha) != file_fingerprint(hb)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_inspect_cli(tiny_int8):
    ok = _cli("tp2.inspect", tiny_int8, "--tp-size", "2", "--json")
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    rows = {r["name"]: r for r in doc["tensors"]}
    assert rows["blocks.0.attn.qkv_proj.weight"]["style"] == "colwise_packed"
    assert rows["blocks.0.attn.qkv_proj.weight"]["local_shapes"] == [[768, 256], [768, 256]]
    assert doc["fingerprint"] == resolve_plan(CheckpointLayout.from_file(tiny_int8), 2).fingerprint()
    bad = _cli("tp2.inspect", tiny_int8, "--tp-size", "4")
    assert bad.returncode == 2
    assert "local K (128) is not a multiple of its ConvRot group (256)" in bad.stderr and "Use tp_size 1 or 2." in bad.stderr


def test_ranks_recording_checks_at_once_all_stay_recorded(tmp_path, monkeypatch):
    """Two processes (two ranks of one machine) record checked files into the shared record at the same time."""
    files = [tmp_path / f"rank{r}_{i}.safetensors" for r in range(2) for i in range(100)]  # the record keeps 200
    for f in files:
        f.write_bytes(b"x")
    go = tmp_path / "go"
    code = (
        "import os, sys, time; from tp2.rank_cache import remember_verified\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.001)\n"  # both start writing at the same moment
        "for p in sys.argv[2:]: remember_verified(p, 'digests')\n"
    )
    env = dict(os.environ, TP2_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(go), *map(str, files[r::2])], env=env) for r in range(2)]
    time.sleep(3)  # both imported and waiting
    go.write_text("")
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    monkeypatch.setenv("TP2_CACHE_DIR", str(tmp_path / "cache"))
    missing = [f.name for f in files if not verified_before(str(f), "digests")]
    assert missing == [], f"{len(missing)} of {len(files)} records lost to the other rank's writes: {missing[:5]}"
