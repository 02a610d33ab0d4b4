"""Tensors read, hashed and written on several threads (tp2/safetensors_io.py): `ordered_map` keeps the order,
stays at most `workers` items ahead of its consumer and raises an item's error at that item; a file written with
workers is byte-identical to one written in one thread; column reads from many threads at once (each with its own
buffer) equal one thread's; shard-on-read and the rank cache's digests are unchanged by the threads."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch
from conftest import shard_state_dict

import tp2.safetensors_io as sio
from tp2.safetensors_io import PendingTensor, TensorReader, ordered_map, write_streaming


def test_results_come_in_order_whatever_order_they_finish_in():
    def slow_first(i):
        time.sleep(0.05 if i % 3 == 0 else 0.0)
        return i * i

    assert list(ordered_map(slow_first, range(20), workers=4)) == [i * i for i in range(20)]
    assert list(ordered_map(slow_first, range(5), workers=1)) == [0, 1, 4, 9, 16]


def test_at_most_workers_items_run_ahead_of_the_consumer():
    started, lock = [], threading.Lock()

    def note(i):
        with lock:
            started.append(i)
        return i

    for consumed in ordered_map(note, range(30), workers=3):
        time.sleep(0.01)  # let the pool run as far ahead as it may
        with lock:
            assert max(started) <= consumed + 3, (consumed, sorted(started))


def test_an_error_is_raised_at_its_item():
    def fail_at_5(i):
        if i == 5:
            raise ValueError("item 5")
        return i

    got = []
    with pytest.raises(ValueError, match="item 5"):
        for x in ordered_map(fail_at_5, range(50), workers=4):
            got.append(x)
    assert got == [0, 1, 2, 3, 4]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"t{i}": torch.randint(-128, 127, (64 + 16 * i, 48), generator=g, dtype=torch.int8)
        if i % 2
        else torch.randn(33, 7 + i, generator=g)
        for i in range(12)
    }


def test_a_file_written_with_workers_is_byte_identical(tmp_path):
    data = _tensors(0)
    pending = [PendingTensor(n, t.dtype, tuple(t.shape), lambda t=t: t) for n, t in data.items()]
    one, many = str(tmp_path / "one.safetensors"), str(tmp_path / "many.safetensors")
    write_streaming(one, pending, {"k": "v"}, digests_key="digests")
    write_streaming(many, pending, {"k": "v"}, digests_key="digests", workers=4)
    assert hashlib.sha256(open(one, "rb").read()).digest() == hashlib.sha256(open(many, "rb").read()).digest()


def test_column_reads_from_many_threads_equal_one_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(sio, "READ_CHUNK_BYTES", 256)  # many chunks per read, so the threads' buffers interleave
    data = _tensors(1)
    path = str(tmp_path / "cols.safetensors")
    write_streaming(path, [PendingTensor(n, t.dtype, tuple(t.shape), lambda t=t: t) for n, t in data.items()])
    cuts = [(n, a, a + 4) for n in data for a in (0, 2, 3)]
    with TensorReader(path) as reader:
        read = lambda n, a, b: reader.read_cols(n, a, b, torch.empty(len(data[n]), b - a, dtype=data[n].dtype))  # noqa: E731
        got = list(ordered_map(lambda c: read(*c), cuts * 4, workers=8))
    for (n, a, b), t in zip(cuts * 4, got):
        assert torch.equal(t, data[n][:, a:b]), (n, a, b)


def test_shard_on_read_is_the_same_with_and_without_threads(tiny_int8, monkeypatch):
    many, _, _ = shard_state_dict(tiny_int8, 2, 1)
    monkeypatch.setattr("tp2.shard.ordered_map", lambda fn, items: map(fn, items))
    one, _, _ = shard_state_dict(tiny_int8, 2, 1)
    assert sorted(many) == sorted(one)
    assert all(many[n].dtype == one[n].dtype and torch.equal(many[n], one[n]) for n in one)
