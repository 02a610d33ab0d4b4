"""Entries in the rank store signed with the run's secret (HMAC-SHA256): stop notices, heartbeats, rendezvous records
and counters (the cache epoch). Something other than the ranks that writes to the store (it listens on loopback, without a
password) cannot sign: an entry without a valid signature is logged by its reader, never acted on or shown.
Without a secret (the front door off) entries are plain. Imports nothing from the pack."""

from __future__ import annotations

import hashlib
import hmac
import json


def sign(secret: str, run: str, rank: int, reason: str) -> str:
    return hmac.new(secret.encode(), f"{run}\n{rank}\n{reason}".encode(), hashlib.sha256).hexdigest()


def signed(secret: str | None, where: str, value: str) -> str:
    """`value` with the run's signature for the store key `where` appended ("value|mac"); as it is without a secret."""
    return value if secret is None else f"{value}|{sign(secret, where, -1, value)[:32]}"


def unsigned(secret: str | None, where: str, raw: str) -> str | None:
    """The value of a `signed` store entry, or None when it does not carry a valid signature for `where`."""
    if secret is None:
        return raw
    value, _, mac = raw.rpartition("|")
    return value if value and hmac.compare_digest(mac, sign(secret, where, -1, value)[:32]) else None


def decode_stop(raw: bytes, run: str, secret: str | None) -> tuple[int, str] | None:
    """(rank, reason) of a stop notice, or None when it is malformed or not signed by a rank."""
    try:
        d = json.loads(raw)
        rank, reason = int(d["rank"]), str(d["reason"])
    except (ValueError, KeyError, TypeError):
        return None
    if secret is not None and not hmac.compare_digest(str(d.get("mac", "")), sign(secret, run, rank, reason)):
        return None
    return rank, reason


def signed_counter(store, key: str, secret: str | None, bump: bool = False, floor: int = 0) -> int | None:
    """The `signed` counter at `key` in `store` (0 before the first); `bump`: raised to one past it (and past `floor`), by
    compare-and-set, as ranks may raise it at once. A value no rank signed reads as None; a raise writes over it."""
    while True:
        raw = store.get(key).decode() if store.check([key]) else ""
        value = unsigned(secret, key, raw) if raw else "0"
        count = int(value) if value is not None and value.isdigit() else None
        if not bump:
            return count
        new = signed(secret, key, str(max(count or 0, floor) + 1))
        if store.compare_set(key, raw, new).decode() == new:
            return max(count or 0, floor) + 1
