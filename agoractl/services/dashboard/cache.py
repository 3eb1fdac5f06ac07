"""The Dashboard's response cache, for a public page behind a CDN (report §3.6.4): each key (an endpoint and
its query) is computed at most once per period whatever the request rate (concurrent requests for a stale key
wait for the one computing it), and its JSON body carries an ETag so a client or CDN revalidates with
``If-None-Match`` and gets ``304``."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Entry:
    value: Any
    body: bytes
    etag: str
    status: int
    at: float


def encode(value: Any, status: int = 200, at: float = 0.0) -> Entry:
    body = json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    return Entry(value, body, '"' + hashlib.sha256(body).hexdigest()[:32] + '"', status, at)


def matches(if_none_match: str | None, etag: str) -> bool:
    """Whether an If-None-Match header names ETAG (weak comparison, as RFC 9110 asks for GET)."""
    if not if_none_match:
        return False
    tags = [t.strip().removeprefix("W/") for t in if_none_match.split(",")]
    return "*" in tags or etag in tags


class Cache:
    """Entries by key, each fresh for PERIOD_S seconds (CLOCK: time.monotonic)."""

    def __init__(self, period_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s, self.clock = period_s, clock
        self._entries: dict[str, Entry] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.computed: dict[str, int] = {}
        """Times each key was computed (one database read each): the cache test reads it."""

    def fresh(self, key: str) -> Optional[Entry]:
        """KEY's entry if it is within its period (no waiting, no computing), else None."""
        entry = self._entries.get(key)
        return entry if entry is not None and self.clock() - entry.at < self.period_s else None

    def get(self, key: str, compute: Callable[[], tuple[Any, int]]) -> Entry:
        """KEY's entry, computing (value, status) with COMPUTE only when it is missing or older than the period
        (blocks while another thread computes it: call from a worker thread)."""
        entry = self.fresh(key)
        if entry is not None:
            return entry
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            entry = self._entries.get(key)  # another request may have computed it while this one waited
            if entry is not None and self.clock() - entry.at < self.period_s:
                return entry
            at = self.clock()
            value, status = compute()
            entry = self._entries[key] = encode(value, status, at)
            self.computed[key] = self.computed.get(key, 0) + 1
            return entry

    def max_age(self, entry: Entry) -> int:
        """Seconds the entry stays fresh (Cache-Control max-age), at least 0."""
        return max(0, int(entry.at + self.period_s - self.clock()))
