"""The rank cache (tp2/rank_cache.py): a rank's slices cut once to a file and mapped from it equal shard-on-read bit
for bit (the DiT's int8 and the text encoder's nvfp4 block scales); the file is reused, a damaged one is deleted and
cut again (so is one that records another cut), a full disk falls back to shard-on-read; `python -m tp2.rank_cache`
cuts the same files ahead of time."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import shard_state_dict
from safetensors.torch import load_file, save_file

import tp2.rank_cache as rank_cache
from tp2.checkpoint import CheckpointLayout
from tp2.errors import PlanError
from tp2.rank_cache import open_rank_shard
from tp2.safetensors_io import DTYPES, read_header
from tp2.shard import read_shard
from tp2.te_plan import resolve_te_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TP2_CACHE_DIR", str(tmp_path / "verified"))


def _equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def _cache_files(cache: str) -> list[str]:
    d = os.path.join(cache, "rank_cache")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


@pytest.mark.parametrize("tp_size", [2])  # the tiny int8 file's ConvRot group allows 1 and 2 (1: mapped whole)
def test_dit_slices_from_the_cache_equal_shard_on_read(tiny_int8, tmp_path, tp_size):
    cache = str(tmp_path / "cache")
    for rank in range(tp_size):
        ref, ref_md, plan = shard_state_dict(tiny_int8, tp_size, rank)
        shard = open_rank_shard(tiny_int8, rank, tp_size, cache, load_file)
        _equal(shard.state_dict, ref)
        assert shard.metadata == ref_md and shard.plan.fingerprint() == plan.fingerprint()
        assert shard.origin.startswith("rank cache ") and f"tp{tp_size}-rank{rank}" in shard.origin
    files = _cache_files(cache)
    assert len(files) == tp_size
    mtimes = [os.stat(os.path.join(cache, "rank_cache", f)).st_mtime_ns for f in files]
    last = tp_size - 1
    _equal(open_rank_shard(tiny_int8, last, tp_size, cache, load_file).state_dict, shard_state_dict(tiny_int8, tp_size, last)[0])
    assert [os.stat(os.path.join(cache, "rank_cache", f)).st_mtime_ns for f in files] == mtimes, "a cache file was rewritten"


def test_cache_files_start_their_tensors_on_64_byte_boundaries(tiny_int8, tmp_path):
    """As in memory: a CPU BLAS rounds a one-row product by where the weight starts, so a slice mapped at another
    offset than a slice read into memory computed other last bits (the pre-cut forms' latents in the ComfyUI suite).
    Every tensor of whole 64-byte lines starts on a boundary; the few others (quant markers, scalars) come last."""
    cache = str(tmp_path / "cache")
    for rank in range(2):
        open_rank_shard(tiny_int8, rank, 2, cache, load_file)
    for name in _cache_files(cache):
        infos = sorted(read_header(os.path.join(cache, "rank_cache", name)).tensors.values(), key=lambda i: i.start)
        lines = [math.prod(i.shape) * DTYPES[i.dtype].itemsize % 64 == 0 for i in infos]  # in file order
        assert lines == sorted(lines, reverse=True) and sum(lines) > len(lines) // 2, name
        assert all(i.start % 64 == 0 for i, whole in zip(infos, lines) if whole), name


def test_tp_size_1_maps_the_file_whole(tiny_int8, tmp_path):
    shard = open_rank_shard(tiny_int8, 0, 1, str(tmp_path / "cache"), load_file)
    assert shard.origin == "mapped whole" and _cache_files(str(tmp_path / "cache")) == []
    _equal(shard.state_dict, shard_state_dict(tiny_int8, 1, 0)[0])


def test_without_a_cache_dir_it_is_shard_on_read(tiny_int8):
    shard = open_rank_shard(tiny_int8, 0, 2)
    assert shard.origin == "shard-on-read"
    _equal(shard.state_dict, shard_state_dict(tiny_int8, 2, 0)[0])


@pytest.fixture(scope="module")
def tiny_te_nvfp4(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("te") / "te_nvfp4.safetensors")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_qwen3vl.py"), path, "--format", "nvfp4"], check=True)
    return path


@pytest.mark.parametrize("tp_size", [2, 4])
def test_text_encoder_nvfp4_slices_from_the_cache_equal_shard_on_read(tiny_te_nvfp4, tmp_path, tp_size):
    plan = resolve_te_plan(CheckpointLayout.from_file(tiny_te_nvfp4), tp_size)
    cache = str(tmp_path / "cache")
    for rank in range(tp_size):
        shard = open_rank_shard(tiny_te_nvfp4, rank, tp_size, cache, load_file)
        _equal(shard.state_dict, read_shard(tiny_te_nvfp4, plan.tensors, rank, tp_size))
        assert shard.metadata == read_header(tiny_te_nvfp4).metadata and shard.origin.startswith("rank cache ")
        assert shard.plan.fingerprint() == plan.fingerprint()


def test_a_damaged_cache_file_is_deleted_and_cut_again(tiny_int8, tmp_path, caplog):
    cache = str(tmp_path / "cache")
    ref = shard_state_dict(tiny_int8, 2, 1)[0]
    open_rank_shard(tiny_int8, 1, 2, cache, load_file)
    (name,) = _cache_files(cache)
    path = os.path.join(cache, "rank_cache", name)
    with open(path, "r+b") as f:  # flip one byte of the last tensor's data
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="tp2.rank_cache"):
        shard = open_rank_shard(tiny_int8, 1, 2, cache, load_file)
    assert "does not match its digest" in caplog.text and "cutting it again" in caplog.text
    _equal(shard.state_dict, ref)
    assert shard.origin.startswith("rank cache ")


def test_no_room_on_disk_falls_back_to_shard_on_read(tiny_int8, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(rank_cache, "SPARE_BYTES", 1 << 60)
    cache = str(tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="tp2.rank_cache"):
        shard = open_rank_shard(tiny_int8, 0, 2, cache, load_file)
    assert shard.origin == "shard-on-read" and _cache_files(cache) == []
    assert "GB needed" in caplog.text and "TP2_CACHE_DIR" in caplog.text
    _equal(shard.state_dict, shard_state_dict(tiny_int8, 2, 0)[0])


def test_cut_ahead_by_the_cli_then_loaded_without_cutting(tiny_float, tiny_te_nvfp4, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "tp2.rank_cache", *args, "--cache-dir", cache], cwd=ROOT, capture_output=True, text=True, timeout=120
        )

    ok = run(tiny_float, "--tp-size", "2")
    assert ok.returncode == 0, ok.stderr
    assert [n.split(".")[-2] for n in _cache_files(cache)] == ["tp2-rank0", "tp2-rank1"]
    te = run(tiny_te_nvfp4, "--tp-size", "2", "--tp-rank", "1")  # the text encoder's plan, one rank
    assert te.returncode == 0 and len(_cache_files(cache)) == 3, te.stderr
    bad = run(tiny_float, "--tp-size", "3")
    assert bad.returncode == 2 and "heads (4) across tp_size=3: not divisible. Use tp_size 1, 2 or 4." in bad.stderr
    monkeypatch.setattr(rank_cache, "write_cache_file", lambda *a, **k: pytest.fail("cut again at load"))
    for rank in range(2):
        shard = open_rank_shard(tiny_float, rank, 2, cache, load_file)
        _equal(shard.state_dict, shard_state_dict(tiny_float, 2, rank)[0])
        assert shard.origin.startswith("rank cache ")
    plan = resolve_te_plan(CheckpointLayout.from_file(tiny_te_nvfp4), 2)
    _equal(open_rank_shard(tiny_te_nvfp4, 1, 2, cache, load_file).state_dict, read_shard(tiny_te_nvfp4, plan.tensors, 1, 2))


def test_a_cache_file_recording_another_cut_is_cut_again_and_never_taken_for_a_checkpoint(tiny_int8, tmp_path, caplog):
    cache = str(tmp_path / "cache")
    open_rank_shard(tiny_int8, 0, 2, cache, load_file)
    (name,) = _cache_files(cache)
    path = os.path.join(cache, "rank_cache", name)
    with pytest.raises(PlanError, match=r"is already a tensor-parallel shard \(rank 0 of 2\); it cannot be sliced again"):
        shard_state_dict(path, 2, 0)
    forged = dict(read_header(path).metadata, **{"tp2.plan": "0123456789abcdef"})
    save_file(load_file(path), path, metadata=forged)
    with caplog.at_level(logging.WARNING, logger="tp2.rank_cache"):
        shard = open_rank_shard(tiny_int8, 0, 2, cache, load_file)
    assert "is not this rank's cut of its checkpoint" in caplog.text and "0123456789abcdef" in caplog.text
    _equal(shard.state_dict, shard_state_dict(tiny_int8, 2, 0)[0])
    assert read_header(path).metadata["tp2.plan"] != "0123456789abcdef"


def test_a_checked_cache_file_is_not_hashed_again_until_it_changes(tiny_int8, tmp_path, monkeypatch):
    import tp2.safetensors_io as safetensors_io

    cache = str(tmp_path / "cache")
    open_rank_shard(tiny_int8, 0, 2, cache, load_file)  # cut: hashed as written, remembered
    calls = []
    real = safetensors_io.tensor_digest  # what load_cache_file hashes with (through safetensors_io.hashed_tensors)
    monkeypatch.setattr(safetensors_io, "tensor_digest", lambda t: calls.append(1) or real(t))
    open_rank_shard(tiny_int8, 0, 2, cache, load_file)
    assert calls == []  # the second start reads, but does not re-hash
    (name,) = _cache_files(cache)
    path = os.path.join(cache, "rank_cache", name)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 1_000_000_000))
    open_rank_shard(tiny_int8, 0, 2, cache, load_file)
    assert len(calls) > 0  # touched: checked again


def test_an_earlier_versions_cache_file_is_removed_when_a_new_one_is_cut(tiny_int8, tmp_path):
    cache = str(tmp_path / "cache")
    folder = os.path.join(cache, "rank_cache")
    os.makedirs(folder)
    stem = os.path.splitext(os.path.basename(tiny_int8))[0]
    stale = f"{stem}.{'a' * 12}.{'b' * 12}.tp2-rank0.safetensors"  # another checkpoint version, same rank and size
    other_rank = f"{stem}.{'a' * 12}.{'b' * 12}.tp2-rank1.safetensors"
    other_model = f"other.{'a' * 12}.{'b' * 12}.tp2-rank0.safetensors"
    for name in (stale, other_rank, other_model, stale + ".partial"):
        open(os.path.join(folder, name), "wb").close()
    open_rank_shard(tiny_int8, 0, 2, cache, load_file)
    left = _cache_files(cache)
    assert stale not in left and other_rank in left and other_model in left and len(left) == 3, left


def test_a_stopped_cut_leaves_nothing_behind_once_the_next_cut_runs(tiny_int8, tmp_path, monkeypatch, caplog):
    cache = str(tmp_path / "cache")

    def stopped(path, pending, metadata, **_):  # the process ended mid-write: only the .partial is left
        with open(path + ".partial", "wb") as f:
            f.write(b"\0" * 4096)
        raise KeyboardInterrupt

    monkeypatch.setattr(rank_cache, "write_streaming", stopped)
    with pytest.raises(KeyboardInterrupt):
        open_rank_shard(tiny_int8, 0, 2, cache, load_file)
    (partial,) = _cache_files(cache)
    assert partial.endswith(".tp2-rank0.safetensors.partial")
    monkeypatch.undo()
    monkeypatch.setenv("TP2_CACHE_DIR", str(tmp_path / "verified"))
    with caplog.at_level(logging.INFO, logger="tp2.rank_cache"):
        shard = open_rank_shard(tiny_int8, 0, 2, cache, load_file)
    assert shard.origin.startswith("rank cache ")
    assert _cache_files(cache) == [partial[: -len(".partial")]]
    assert any("a cut that was stopped before it ended" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.001, 0.0, "header"], ids=["half", "last_bytes", "in_header", "empty", "malformed"])
def test_a_cache_file_cut_short_is_deleted_and_read_again_naming_it(tiny_int8, tmp_path, caplog, keep):
    """A cache file cut short (issue 39: every prompt failed with "the checkpoint is truncated", blaming the intact
    checkpoint) is treated as a digest mismatch: the warning names the cache file, the file is cut again, the slices
    equal shard-on-read. Read by tp2's reader (pread), as ranks without dynamic VRAM do: no mapping, no SIGBUS."""
    from tp2.safetensors_io import read_tensors

    cache = str(tmp_path / "cache")
    open_rank_shard(tiny_int8, 1, 2, cache, read_tensors)
    (name,) = _cache_files(cache)
    path = os.path.join(cache, "rank_cache", name)
    if keep == "header":  # a header of the right length that is not a safetensors header
        with open(path, "r+b") as f:
            n = int.from_bytes(f.read(8), "little")
            f.write(b'{"x": {}}'.ljust(n))  # valid JSON, no dtype: a KeyError in the parser before
    else:
        os.truncate(path, int(os.path.getsize(path) * keep))
    with caplog.at_level(logging.WARNING, logger="tp2.rank_cache"):
        shard = open_rank_shard(tiny_int8, 1, 2, cache, read_tensors)
    assert f"rank cache file {path} cannot be used" in caplog.text and "cutting it again" in caplog.text, caplog.text
    assert "checkpoint is truncated" not in caplog.text
    _equal(shard.state_dict, shard_state_dict(tiny_int8, 2, 1)[0])
    assert shard.origin.startswith("rank cache ") and os.path.getsize(path) > 1000


def test_a_cache_file_cut_short_after_its_check_fails_its_read_not_the_process(tiny_int8, tmp_path, caplog, monkeypatch):
    """Cut short between the check and the read (another process, while this one loads): the read raises, the file is
    deleted and, when cutting is off, the slices come from the checkpoint."""
    from tp2.safetensors_io import read_tensors

    cache = str(tmp_path / "cache")
    open_rank_shard(tiny_int8, 0, 2, cache, read_tensors)
    (name,) = _cache_files(cache)
    path = os.path.join(cache, "rank_cache", name)

    def cut_then_read(p):
        os.truncate(p, os.path.getsize(p) // 2)
        return read_tensors(p)

    with caplog.at_level(logging.WARNING, logger="tp2.rank_cache"):
        shard = open_rank_shard(tiny_int8, 0, 2, cache, cut_then_read, cut=False)
    assert f"rank cache file {path} cannot be used ('{path}': Unexpected end of file" in caplog.text, caplog.text
    assert "reading from the checkpoint" in caplog.text and shard.origin == "shard-on-read" and _cache_files(cache) == []
    _equal(shard.state_dict, shard_state_dict(tiny_int8, 2, 0)[0])


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs (root only): smaller than any rank's cut of the tiny checkpoints."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "full"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], check=True)
    yield str(where)
    subprocess.run(["umount", str(where)], check=True)


def test_a_disk_that_fills_while_cutting_is_one_line_and_leaves_nothing(tiny_int8, full_disk, monkeypatch, capsys, caplog):
    """The free-space check passed (another writer filled the disk after it, shown here by a negative spare): the
    write's ENOSPC is one warning and one error line, not a traceback, and no .partial holds the space."""
    monkeypatch.setattr(rank_cache, "SPARE_BYTES", -(1 << 40))
    assert rank_cache.main([tiny_int8, "--tp-size", "2", "--tp-rank", "0", "--cache-dir", full_disk]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: not enough free disk in ") and "Traceback" not in err, err
    assert "failed ([Errno 28] No space left on device)" in caplog.text, caplog.text
    assert os.listdir(os.path.join(full_disk, "rank_cache")) == []


def test_the_cli_on_a_full_disk_says_so_in_one_line(tiny_int8, full_disk):
    res = subprocess.run(
        [sys.executable, "-m", "tp2.rank_cache", tiny_int8, "--tp-size", "2", "--cache-dir", full_disk],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr and "GB needed" in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: not enough free disk in "), res.stderr
