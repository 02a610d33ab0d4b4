"""Which rank-cache files were checked whole against their digests, remembered per machine
(TP2_CACHE_DIR/verified_rank_files.json) by real path, size, mtime and digests, so a file is read twice only when
one of those changed. A file damaged in place with its size and mtime unchanged is not caught after its first check.
Imports nothing from `comfy`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os

from . import settings

log = logging.getLogger(__name__)


def _cache_file() -> str:
    return os.path.join(settings.cache_dir(), "verified_rank_files.json")


def _file_key(path: str, digests: str) -> str:
    st = os.stat(path)
    return json.dumps([os.path.realpath(path), st.st_size, st.st_mtime_ns, hashlib.sha256(digests.encode()).hexdigest()[:16]])


def verified_before(path: str, digests: str) -> bool:
    """Whether this file, at this size and mtime and with these digests, was checked whole before."""
    try:
        with open(_cache_file()) as f:
            return _file_key(path, digests) in json.load(f)
    except (OSError, ValueError):
        return False


def remember_verified(path: str, digests: str) -> None:
    """Record that `path` was checked whole. The ranks of one machine share the record: the read, update and
    replace run under an exclusive lock on `<record>.lock`, so two ranks recording at once both stay recorded."""
    cache = _cache_file()
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        with open(cache + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with open(cache) as f:
                    known = [k for k in json.load(f) if json.loads(k)[0] != os.path.realpath(path)]
            except (OSError, ValueError):
                known = []
            tmp = f"{cache}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump([*known[-200:], _file_key(path, digests)], f)
            os.replace(tmp, cache)
    except OSError as e:  # a read-only home: the file is simply checked again next time
        log.warning("could not record that %s was checked (%s)", path, e)
