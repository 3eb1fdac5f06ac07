"""A worker's activation cache: the autograd graphs of its recent forwards, so that the backward of the
same samples on the same worker runs without the recompute of the stateless path (report §3.3.1.4
recomputes; keeping activations is what a pinned worker can do instead).

A forward batch (one coalesced compute pass) is stored as one :class:`Entry`: its output with its graph,
its input (whose ``.grad`` the backward fills) and the row count of each request. Requests are found
again by content: the key of a request is a digest of its token ids and input wire tensor, which the
trainer sends again with the backward. An entry serves the backward of each of its requests while the
stage's parameters are unchanged since the forward (their autograd version counters: an optimizer step, an
averaging round or a checkpoint load all bump them); otherwise it is dropped and those requests take the
stateless recompute, so results never depend on whether the cache held them. Requests coalesced into one
forward may come back in different backward batches: each runs the backward through the shared graph with a
zero gradient on the other requests' rows (samples never mix within a stage), and the graph is kept until the
last of them has run. A backward served elsewhere (another replica) simply never comes back.

Memory is bounded by ``workers.activation_cache_mb``: an entry's size is the bytes of the distinct
storages autograd saved during its forward (parameters excluded) plus its input and output; storing an
entry first evicts the oldest ones until the total fits, and an entry larger than the whole bound is not
kept.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch


def request_key(ids: torch.Tensor, wire: Optional[torch.Tensor]) -> bytes:
    """The digest of a request's token ids and input wire tensor (dtype and shape included)."""
    h = hashlib.blake2b(digest_size=16)
    for t in (ids, wire):
        if t is None:
            h.update(b"-")
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    return h.digest()


def param_version(params: Iterable[torch.Tensor]) -> int:
    """Sum of the parameters' autograd version counters: it grows with every in-place change."""
    return sum(p._version for p in params)


@dataclass
class Entry:
    """One cached forward batch."""

    keys: list[bytes]
    sizes: list[int]
    output: torch.Tensor
    input: Optional[torch.Tensor]
    version: int
    nbytes: int = 0
    served: list[bool] = field(default_factory=list)
    """Per request: its backward ran on this graph already (the graph is kept until every request's has)."""

    def __post_init__(self):
        self.served = self.served or [False] * len(self.keys)


@dataclass
class CacheStats:
    hits: int = 0
    """Requests whose backward ran on their cached forward graph."""
    misses: int = 0
    """Backward requests that took the recompute (not cached, evicted, partial batch or stale weights)."""
    evicted: int = 0
    """Entries dropped to stay within the bound (or too large to keep)."""
    stale: int = 0
    """Entries dropped because the parameters changed since their forward."""
    peak_bytes: int = 0
    """The most bytes the cache held at once."""


class SavedBytes:
    """Context manager counting the distinct storages autograd saves for backward (parameters excluded)."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.skip:
            self.seen[ptr] = storage.nbytes()
        return t.detach()  # not `t`: a saved output would hold its own graph node, a cycle never freed

    def add(self, *tensors: Optional[torch.Tensor]) -> None:
        for t in tensors:
            if t is not None:
                self._pack(t)

    @property
    def nbytes(self) -> int:
        return sum(self.seen.values())

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class ActivationCache:
    """Forward graphs by request key, oldest evicted first, at most `limit_bytes` in all."""

    def __init__(self, limit_bytes: int):
        self.limit = int(limit_bytes)
        self.entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self.by_key: dict[bytes, list[int]] = {}
        self.used = 0
        self.stats = CacheStats()
        self._next = 0

    def __len__(self) -> int:
        return len(self.entries)

    def store(self, entry: Entry) -> bool:
        """Keep `entry`, evicting the oldest entries as needed; False if it alone exceeds the bound."""
        if entry.nbytes > self.limit:
            self.stats.evicted += 1
            return False
        while self.entries and self.used + entry.nbytes > self.limit:
            self.drop(next(iter(self.entries)))
            self.stats.evicted += 1
        eid, self._next = self._next, self._next + 1
        self.entries[eid] = entry
        self.used += entry.nbytes
        for k in entry.keys:
            self.by_key.setdefault(k, []).append(eid)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.used)
        return True

    def samples(self) -> int:
        """Samples of the kept entries whose backwards have not come yet."""
        return sum(n for e in self.entries.values() for n, done in zip(e.sizes, e.served) if not done)

    def summary(self) -> dict:
        st = self.stats
        return {"hits": st.hits, "misses": st.misses, "evicted": st.evicted, "stale": st.stale,
                "peak_mb": round(st.peak_bytes / 2**20, 2), "limit_mb": round(self.limit / 2**20, 2)}

    def drop(self, eid: int) -> None:
        entry = self.entries.pop(eid, None)
        if entry is None:
            return
        self.used -= entry.nbytes
        for k in entry.keys:
            ids = self.by_key.get(k, [])
            if eid in ids:
                ids.remove(eid)
            if not ids:
                self.by_key.pop(k, None)

    def clear(self) -> None:
        for eid in list(self.entries):
            self.drop(eid)

    def take(self, keys: list[bytes], version: int) -> tuple[list[tuple[Entry, list[Optional[int]]]], list[int]]:
        """For a backward batch's request keys: ([(entry, per request of the entry in its row order: the position
        in `keys` of the request served now, or None)] for the entries the batch draws on, [positions to
        recompute]). An entry leaves the cache once each of its requests has been served; until then the
        caller keeps its graph (``retain_graph``) for the rest. An entry of other weights is dropped unused."""
        claimed: dict[int, list[Optional[int]]] = {}
        misses: list[int] = []
        for pos, k in enumerate(keys):
            placed = False
            for eid in self.by_key.get(k, []):
                entry = self.entries[eid]
                slots = claimed.setdefault(eid, [None] * len(entry.keys))
                free = [i for i, ek in enumerate(entry.keys) if ek == k and slots[i] is None and not entry.served[i]]
                if free:
                    slots[free[0]] = pos
                    placed = True
                    break
            if not placed:
                misses.append(pos)
        hits: list[tuple[Entry, list[Optional[int]]]] = []
        for eid, slots in claimed.items():
            entry = self.entries[eid]
            if entry.version != version:
                self.stats.stale += 1
                misses.extend(s for s in slots if s is not None)
                self.drop(eid)
                continue
            hits.append((entry, slots))
            entry.served = [done or s is not None for done, s in zip(entry.served, slots)]
            if all(entry.served):
                self.drop(eid)
        self.stats.hits += sum(s is not None for _, slots in hits for s in slots)
        self.stats.misses += len(misses)
        return hits, sorted(misses)
