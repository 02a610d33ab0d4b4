"""Shard-on-read memory: one rank of 2 reads a >= 1 GB checkpoint while its peak RSS grows by < 60% of the file.

Measured in a fresh process: the peak-RSS counter (VmHWM) is reset after the imports, so the number is what
sharding itself costs (its half of the sharded tensors, the replicated ones, one read chunk), not torch.
"""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import make_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import sys
from tp2.rank_cache import open_rank_shard

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
base = status("VmRSS:")
shard = open_rank_shard(sys.argv[1], 1, 2)
sd, plan = shard.state_dict, shard.plan
kept = sum(t.numel() * t.element_size() for t in sd.values())
print(base, status("VmHWM:"), kept)
"""


def test_shard_on_read_peak_rss_under_60_percent(tmp_path):
    path = make_checkpoint(
        str(tmp_path / "h3_1gb.safetensors"),
        *("--hidden", "2048", "--heads", "16", "--ffn", "8192", "--layers", "4", "--refiner-layers", "0", "--text-dim", "1024"),
    )
    size = os.path.getsize(path)
    assert size >= 1 << 30, size
    res = subprocess.run([sys.executable, "-c", PROBE, path], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    base, peak, kept = map(int, res.stdout.split())
    growth = peak - base
    print(
        f"\nfile {size / 2**20:.0f} MiB; rank 1/2 keeps {kept / 2**20:.0f} MiB; peak RSS growth {growth / 2**20:.0f} MiB "
        f"= {100 * growth / size:.1f}% of the file (RSS before {base / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB)"
    )
    assert growth < 0.60 * size
    assert kept < 0.55 * size  # the shard itself is about half
