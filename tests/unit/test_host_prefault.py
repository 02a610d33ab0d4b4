"""tp2/host_prefault.py on this machine's real kernel: the slabs cover a tensor's bytes exactly once, in the order a
writer along `dim` reaches them; populated_ahead maps a fresh buffer's pages (the process's resident memory grows by
the buffer) and never changes a byte, even where the writer got there first; it stops and joins when its block
raises; it leaves small, strided and non-host buffers alone and says why."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from tp2.host_prefault import MIN_BYTES, populated_ahead, slabs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE) is Linux's")


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_slabs_cover_every_byte_once_in_write_order():
    t = torch.empty(2, 3, 10, 4, 5)  # [B, C, T, H, W]; one position along T: 80 bytes
    ranges = slabs(t, dim=2, slab_bytes=1000)  # 1000 // (80 * 6) = 2 positions along T per slab
    base, row = t.data_ptr(), 4 * 5 * 4
    covered = sorted((a - base, a - base + n) for a, n in ranges)
    assert covered[0][0] == 0 and covered[-1][1] == t.numel() * 4
    assert all(end == nxt for (_, end), (nxt, _) in zip(covered, covered[1:])), "gaps or overlaps"
    positions = [((a - base) // row) % 10 for a, _ in ranges]  # the T index each range starts at
    assert positions == sorted(positions), "not in the order a writer along T fills the buffer"
    assert len(ranges) == 5 * 6 and all(n == 2 * row for _, n in ranges)
    with pytest.raises(ValueError, match="contiguous"):
        slabs(t.transpose(0, 1), dim=2)


def test_a_fresh_buffer_is_mapped_by_the_thread():
    size = 256 << 20
    buf = torch.empty(size // 4)  # a fresh mapping: no page resident yet
    before = resident_bytes()
    with populated_ahead(buf.view(1, 4, -1), dim=1) as ahead:
        pass
    grown = resident_bytes() - before
    if ahead.skipped:
        pytest.skip(f"this kernel cannot: {ahead.skipped}")
    assert ahead.done and ahead.bytes == size, ahead
    assert grown >= 0.9 * size, f"resident memory grew by {grown / 2**20:.0f} MiB of {size >> 20} MiB asked for"


def test_contents_are_the_writers_even_where_it_got_there_first():
    t, h, w = 64, 256, 512  # [1, 3, 64, 256, 512] float32: 96 MiB
    src = torch.rand(1, 3, t, h, w, generator=torch.Generator().manual_seed(0))
    buf = torch.empty_like(src)
    with populated_ahead(buf, dim=2) as ahead:
        for i in reversed(range(t)):  # from the end: the thread, going front to back, meets frames already written
            buf[:, :, i].copy_(src[:, :, i])
    assert ahead.skipped or ahead.done
    assert torch.equal(buf, src)


def test_the_thread_stops_and_joins_when_the_block_raises():
    buf = torch.empty(MIN_BYTES // 4 * 2)
    with pytest.raises(RuntimeError, match="decode failed"), populated_ahead(buf):
        raise RuntimeError("decode failed")
    assert not any(th.name == "tp2-prefault" for th in threading.enumerate())


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: torch.empty(1024), "64 MiB"),
        (lambda: torch.empty(MIN_BYTES // 4 * 2).view(2, -1).t(), "contiguous"),
        (lambda: None, "64 MiB"),
    ],
)
def test_buffers_it_leaves_alone(make, why):
    with populated_ahead(make()) as ahead:
        assert not any(th.name == "tp2-prefault" for th in threading.enumerate())
    assert ahead.skipped and why in ahead.skipped and ahead.bytes == 0
