"""Free a safetensors checkpoint's large tensors on disk once each rank's cut of it is in the rank cache, so the models and
the rank caches fit a small disk together (the device's 64 GiB holds the four models, 41 GB, or them plus two ranks' caches,
not both whole): make_models.py --cut-ahead.

The data of every tensor of at least N bytes (1 MiB) is punched out (fallocate PUNCH_HOLE | KEEP_SIZE): the file keeps its
size, name and header, every small tensor (the `.comfy_quant` markers the pack's planner reads) and the 16 windows of
`tp2.safetensors_io.file_fingerprint` (fingerprint_windows), so the rank cache still recognises it as the file its cuts came from. Punched bytes
read back as zeros: a load that reads them would run on zeros, so punch only what the rank cache serves, and check it (the
bench's set-up compares the videos). A `FILE.punched` marker records the punch; make_models.py refuses to cut a marked file.
"""

from __future__ import annotations

import ctypes
import math

from tp2.safetensors_io import DTYPES, fingerprint_windows, read_header  # the pack's folder on sys.path (make_models.py)

PAGE = 4096
PUNCH_HOLE_KEEP_SIZE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def punch(path: str, min_bytes: int = 1 << 20) -> int:
    """Punch out the data of `path`'s tensors of at least `min_bytes`, but the fingerprint's windows; returns bytes freed."""
    header = read_header(path)
    keep = fingerprint_windows(header)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    freed = 0
    with open(path, "r+b") as f:
        for info in header.tensors.values():
            lo = info.start
            hi = lo + math.prod(info.shape) * DTYPES[info.dtype].itemsize
            if hi - lo < min_bytes:
                continue
            for a, b in _gaps(lo, hi, keep):
                a, b = -(-a // PAGE) * PAGE, b // PAGE * PAGE  # whole pages inside the gap
                if b > a:
                    if libc.fallocate(f.fileno(), PUNCH_HOLE_KEEP_SIZE, ctypes.c_long(a), ctypes.c_long(b - a)) != 0:
                        raise OSError(ctypes.get_errno(), f"cannot punch holes in {path} (its file system may not support it)")
                    freed += b - a
    open(path + ".punched", "w").write(f"{freed}\n")
    return freed


def _gaps(lo: int, hi: int, keep: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[lo, hi) without the kept ranges."""
    gaps, cur = [], lo
    for a, b in sorted(keep):
        if b > cur and a < hi:
            gaps.append((cur, a))
            cur = max(cur, b)
    return [(a, b) for a, b in gaps + [(cur, hi)] if b > a]
