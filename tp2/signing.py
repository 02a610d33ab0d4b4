"""Entries in the rank store signed with the run's secret (HMAC-SHA256): stop notices, heartbeats, rendezvous records
and counters (the cache epoch). Something other than the ranks that writes to the store (it listens on loopback, without a
password) cannot sign: an entry without a valid signature is logged by its reader, never acted on or shown.
Without a secret (the front door off) entries are plain. Imports nothing from the pack."""

from __future__ import annotations

import hashlib
import hmac


def _mac(secret: str, where: str, value: str) -> str:
    return hmac.new(secret.encode(), f"{where}\n{value}".encode(), hashlib.sha256).hexdigest()[:32]


def signed(secret: str | None, where: str, value: str) -> str:
    """`value` with the run's signature for the store key `where` appended ("value|mac"); as it is without a secret."""
    return value if secret is None else f"{value}|{_mac(secret, where, value)}"


def unsigned(secret: str | None, where: str, raw: str) -> str | None:
    """The value of a `signed` store entry, or None when it does not carry a valid signature for `where`."""
    if secret is None:
        return raw
    value, _, mac = raw.rpartition("|")
    return value if value and hmac.compare_digest(mac, _mac(secret, where, value)) else None


def signed_counter(store, key: str, secret: str | None, bump: bool = False, floor: int = 0) -> tuple[int, bool]:
    """(the `signed` counter at `key` in `store`, 0 before the first, whether a value no rank signed was there); `bump`
    or such a value: raised to one past it (and past `floor`) by compare-and-set, as ranks may raise it at once."""
    while True:
        raw = store.get(key).decode() if store.check([key]) else ""
        value = unsigned(secret, key, raw) if raw else "0"
        count = int(value) if value is not None and value.isdigit() else None
        if not bump and count is not None:
            return count, False
        new = signed(secret, key, str(max(count or 0, floor) + 1))
        if store.compare_set(key, raw, new).decode() == new:
            return max(count or 0, floor) + 1, count is None
