"""Safetensors files without holding them: header parsing, ranged reads, streaming writes.

Reads go through `os.pread` into buffers this process owns (not an mmap), so a rank that takes half of a checkpoint
never has the other half resident. Writes stream one tensor at a time. Reading, hashing and writing release the GIL,
so `ordered_map` runs them on IO_WORKERS threads, results in order. Imports torch only; never `comfy`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .errors import CheckpointFormatError
from .progress import tick

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_CODES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# Rows are read in chunks of about this many bytes when only some columns are kept.
READ_CHUNK_BYTES = 16 << 20
# Threads that read, hash and cut tensors at once (each holds at most one tensor and one read chunk).
IO_WORKERS = max(4, min(8, os.cpu_count() or 1))  # 4 even on fewer cores: reads and page faults overlap


def ordered_map(fn: Callable, items: Iterable, workers: int = IO_WORKERS) -> Iterator:
    """fn(item) for every item, in order, computed on up to `workers` threads and at most `workers` items ahead of
    the consumer (so at most that many results are held besides the one being used). workers <= 1: in this thread.
    An exception in fn is raised at its item; the items after it are cancelled or waited for."""
    if workers <= 1:
        yield from map(fn, items)
        return
    it = iter(items)
    with ThreadPoolExecutor(workers, thread_name_prefix="tp2-io") as pool:
        pending = collections.deque(pool.submit(fn, item) for item in itertools.islice(it, workers))
        try:
            while pending:
                result = pending.popleft().result()
                pending.extend(pool.submit(fn, item) for item in itertools.islice(it, 1))
                yield result
        finally:
            for future in pending:
                future.cancel()


def hashed_tensors(reader: TensorReader, names: list[str]) -> Iterator[tuple[str, str]]:
    """(name, its tensor_digest) for every name, in order, read and hashed on IO_WORKERS threads."""
    return zip(names, ordered_map(lambda name: tensor_digest(reader.read(name)), names))


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of its data in the file


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    header_bytes: bytes
    file_size: int


def read_header(path: str) -> SafetensorsHeader:
    """The parsed JSON header of `path` (no tensor data read), parsed once per file version: a file replaced or
    rewritten (another inode, size or mtime) is parsed again. Treat the result as read-only."""
    try:
        st = os.stat(path)
        return _parsed_header(path, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError as e:
        raise CheckpointFormatError(f"Cannot read checkpoint '{path}': {e}.") from e


@functools.lru_cache(maxsize=64)
def _parsed_header(path: str, _inode: int, size: int, _mtime_ns: int) -> SafetensorsHeader:
    with open(path, "rb") as f:  # an OSError: read_header's to report
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise CheckpointFormatError(f"'{path}' is {size} bytes: too short to be a safetensors file.")
        (n,) = struct.unpack("<Q", raw_len)
        if n > size - 8 or n > 512 << 20:
            raise CheckpointFormatError(
                f"'{path}' declares a {n}-byte header in a {size}-byte file: not a safetensors file "
                "(or a truncated download). Re-download it or pass a .safetensors file."
            )
        header_bytes = f.read(n)
    try:
        doc = json.loads(header_bytes)
        metadata = doc.pop("__metadata__", None) or {}
        tensors = {name: TensorInfo(e["dtype"], tuple(e["shape"]), 8 + n + e["data_offsets"][0]) for name, e in doc.items()}
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise CheckpointFormatError(f"'{path}' has no valid safetensors JSON header ({type(e).__name__}: {e}).") from e
    for name, info in tensors.items():
        if info.dtype not in DTYPES:
            raise CheckpointFormatError(f"Tensor '{name}' in '{path}' has dtype {info.dtype}, which this pack cannot read.")
    return SafetensorsHeader(path, tensors, metadata, header_bytes, size)


class TensorReader(contextlib.AbstractContextManager):
    """Reads whole tensors, row ranges or column ranges with `pread`. Use as a context manager."""

    def __init__(self, path: str):
        self.header = read_header(path)
        self._fd = os.open(path, os.O_RDONLY)
        self._local = threading.local()  # each thread's read_cols buffer (pread is safe from several threads)

    def __exit__(self, *exc) -> None:
        os.close(self._fd)
        self._fd, self._local = -1, threading.local()  # a read after this fails; the threads' buffers are freed

    def _read_into(self, info: TensorInfo, start: int, out: torch.Tensor) -> torch.Tensor:
        """Fill the contiguous tensor `out` with the bytes at `start` (relative to the tensor's data)."""
        tick()  # a long load is progress (tp2/progress.py)
        buf, offset, done = memoryview(out.reshape(-1).view(torch.uint8).numpy()), info.start + start, 0
        try:
            while done < len(buf):
                got = os.preadv(self._fd, [buf[done:]], offset + done)
                if got <= 0:
                    raise CheckpointFormatError(f"Unexpected end of file at byte {offset + done}: the file is truncated.")
                done += got
        except (CheckpointFormatError, OSError) as e:
            raise CheckpointFormatError(f"'{self.header.path}': {e}") from e
        return out

    def read(self, name: str) -> torch.Tensor:
        info = self.header.tensors[name]
        return self._read_into(info, 0, torch.empty(info.shape, dtype=DTYPES[info.dtype]))

    def read_rows(self, name: str, row_start: int, row_end: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [row_start, row_end) of dim 0 in one contiguous read into `out`."""
        info = self.header.tensors[name]
        row_bytes = DTYPES[info.dtype].itemsize * math.prod(info.shape[1:])
        return self._read_into(info, row_start * row_bytes, out)

    def read_cols(self, name: str, col_start: int, col_end: int, out: torch.Tensor) -> torch.Tensor:
        """Columns [col_start, col_end) of a 2-D tensor into `out`: whole rows are read in chunks into a buffer that
        each reading thread allocates once per reader (not a temporary per chunk, which fragments the heap)."""
        info = self.header.tensors[name]
        rows, cols = info.shape
        row_bytes = max(1, cols * DTYPES[info.dtype].itemsize)
        rows_per_chunk = max(1, READ_CHUNK_BYTES // row_bytes)
        chunk = getattr(self._local, "chunk", None)
        if chunk is None or chunk.numel() < rows_per_chunk * row_bytes:
            chunk = self._local.chunk = torch.empty(max(READ_CHUNK_BYTES, row_bytes), dtype=torch.uint8)
        for r in range(0, rows, rows_per_chunk):
            r_end = min(rows, r + rows_per_chunk)
            buf = chunk[: (r_end - r) * row_bytes].view(DTYPES[info.dtype]).view(r_end - r, cols)
            out[r:r_end] = self.read_rows(name, r, r_end, buf)[:, col_start:col_end]
        return out


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of `path` read into memory this process owns (pread on IO_WORKERS threads, not a mapping: a file
    another process cuts short raises CheckpointFormatError here, never SIGBUS later)."""
    with TensorReader(path) as reader:
        names = list(reader.header.tensors)
        return dict(zip(names, ordered_map(reader.read, names)))


@dataclass(frozen=True)
class PendingTensor:
    """A tensor to be written: its layout now, its data from `produce()` when its turn comes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]


DIGEST_CHARS = 16  # hex of a 64-bit BLAKE2b: per-tensor content digests in rank files


def tensor_digest(data: torch.Tensor) -> str:
    """The content digest of one tensor's bytes (as stored: contiguous, little-endian)."""
    return hashlib.blake2b(memoryview(data.contiguous().reshape(-1).view(torch.uint8).numpy()), digest_size=DIGEST_CHARS // 2).hexdigest()


def write_streaming(path: str, tensors: list[PendingTensor], metadata: dict[str, str] | None = None,
                    progress: Callable[[int, int], None] | None = None, digests_key: str | None = None, workers: int = 1,
                    align: int = 8) -> None:  # fmt: skip
    """Write a safetensors file one tensor at a time, through `path + ".partial"` renamed at the end. `digests_key`:
    the metadata key for every tensor's `tensor_digest` (placeholders of the same length, rewritten once the data is
    out). `workers` > 1: tensors produced and hashed on that many threads (`produce` must allow any thread and order)."""
    digests = {t.name: "0" * DIGEST_CHARS for t in tensors}
    blob = _header_blob(tensors, metadata, digests_key, digests, align)
    tmp = path + ".partial"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for i, (data, digest) in enumerate(ordered_map(functools.partial(_produced, hashed=digests_key is not None), tensors, workers)):
                if digest is not None:
                    digests[tensors[i].name] = digest
                f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))  # no copy
                del data
                if progress is not None:
                    progress(i + 1, len(tensors))
            if digests_key is not None:
                f.seek(8)
                f.write(_header_blob(tensors, metadata, digests_key, digests, align))
    except BaseException:  # a full disk: the part written would hold the space it needs
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def _produced(t: PendingTensor, hashed: bool) -> tuple[torch.Tensor, str | None]:
    data = t.produce()
    if tuple(data.shape) != tuple(t.shape) or data.dtype != t.dtype:
        raise ValueError(
            f"Tensor '{t.name}' was declared {t.dtype} {list(t.shape)} but produced "
            f"{data.dtype} {list(data.shape)}: the writer's plan and its data disagree."
        )
    data = data.contiguous()
    return data, tensor_digest(data) if hashed else None  # a file without digests (the generators' 20 GB) is not hashed


def _header_blob(tensors: list[PendingTensor], metadata, digests_key: str | None, digests: dict[str, str], align: int) -> bytes:
    """The JSON header, space-padded so that the data starts at a multiple of `align` bytes (a multiple of 8)."""
    header: dict[str, object] = {}
    md = {str(k): str(v) for k, v in (metadata or {}).items()}
    if digests_key is not None:
        md[digests_key] = json.dumps(digests, separators=(",", ":"))
    if md:
        header["__metadata__"] = md
    offset = 0
    for t in tensors:
        nbytes = math.prod(t.shape) * t.dtype.itemsize
        header[t.name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * (-(8 + len(blob)) % align)


def fingerprint_windows(header: SafetensorsHeader, samples: int = 16, sample_bytes: int = 1 << 16) -> list[tuple[int, int]]:
    """The [start, end) byte ranges of the file that file_fingerprint reads: 16 windows of 64 KiB spread over the data."""
    data_start = 8 + len(header.header_bytes)
    span = max(0, header.file_size - data_start - sample_bytes)
    return [(a, a + sample_bytes) for a in (data_start + (span * i) // max(1, samples - 1) for i in range(samples))]


def file_fingerprint(header: SafetensorsHeader) -> str:
    """A cheap identity of a checkpoint (not a hash of all its bytes): its header, its size and its fingerprint_windows'
    data, so a file with the same layout but other weights differs."""
    h = hashlib.sha256(header.header_bytes + str(header.file_size).encode())
    with open(header.path, "rb") as f:
        for a, b in fingerprint_windows(header):
            f.seek(a)
            h.update(f.read(b - a))
    return h.hexdigest()[:16]
