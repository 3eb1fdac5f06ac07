"""AsyncSPARTA maths (report §4.2): segment tiling, weighted averaging and the delta rule.

Pure functions and one small class, no networking: the real worker (over hivemind) and the
in-process simulator share them. The flattened trainable parameters of a stage are tiled by
``n_segments`` disjoint random segments: within every parameter tensor, a permutation drawn from a
generator seeded by (seed, parameter name) deals elements to segments in turn, so every element is
in exactly one segment, every segment takes an equal share of every tensor, and every replica
derives the same tiling from the manifest alone (it is never broadcast). Round ``r`` averages
segment ``r mod n_segments``.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch


class SegmentTiling:
    """Disjoint random segments covering every element of the given parameters exactly once.

    `shapes` maps parameter names to shapes in a fixed order (``named_parameters()`` order). Memory:
    one byte per parameter for the segment ids, plus cached index tensors for segments in use.
    """

    def __init__(self, shapes: Mapping[str, Sequence[int]], segments: int, seed: int = 0):
        if segments < 1 or segments > 255:
            raise ValueError(f"segments must be in 1..255; got {segments}")
        self.segments = segments
        self.seed = seed
        self.names = list(shapes)
        self.numels = {n: int(math.prod(s)) for n, s in shapes.items()}
        self.ids: dict[str, torch.Tensor] = {}
        for name in self.names:
            numel = self.numels[name]
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF)
            perm = torch.randperm(numel, generator=g)
            ids = torch.empty(numel, dtype=torch.uint8)
            # Element perm[j] goes to segment j mod S: equal shares, random positions.
            ids[perm] = (torch.arange(numel) % segments).to(torch.uint8)
            self.ids[name] = ids
        self._cache: dict[int, dict[str, torch.Tensor]] = {}

    def indices(self, segment: int) -> dict[str, torch.Tensor]:
        """Flat element indices of `segment` in each parameter (cached)."""
        if not 0 <= segment < self.segments:
            raise IndexError(f"segment {segment} out of range 0..{self.segments - 1}")
        if segment not in self._cache:
            self._cache[segment] = {n: (self.ids[n] == segment).nonzero().view(-1) for n in self.names}
        return self._cache[segment]

    def size(self, segment: int) -> int:
        return sum(int(i.numel()) for i in self.indices(segment).values())

    def max_size(self) -> int:
        """The largest segment's size (segment 0 takes the remainder of every tensor), computed
        without building any index."""
        return sum(-(-k // self.segments) for k in self.numels.values())

    def release(self, segment: int) -> None:
        """Forget the cached indices of `segment` (8 bytes per value) until it is used again."""
        self._cache.pop(segment, None)

    def gather(self, params: Mapping[str, torch.Tensor], segment: int) -> torch.Tensor:
        """The segment's values from `params`, as one flat fp32 CPU vector (a snapshot copy)."""
        idx = self.indices(segment)
        parts = [params[n].detach().reshape(-1)[idx[n].to(params[n].device)].float().cpu() for n in self.names]
        return torch.cat(parts) if parts else torch.empty(0)

    def _split(self, segment: int, flat: torch.Tensor) -> Iterable[tuple[str, torch.Tensor, torch.Tensor]]:
        idx = self.indices(segment)
        offset = 0
        for n in self.names:
            k = idx[n].numel()
            yield n, idx[n], flat[offset:offset + k]
            offset += k
        if offset != flat.numel():
            raise ValueError(f"segment {segment} has {offset} values; got {flat.numel()}")

    @torch.no_grad()
    def add_(self, params: Mapping[str, torch.Tensor], segment: int, delta: torch.Tensor) -> None:
        """params[segment] += delta (in place)."""
        for n, idx, part in self._split(segment, delta):
            p = params[n]
            flat = p.view(-1)
            idx = idx.to(p.device)
            flat.index_put_((idx,), flat[idx] + part.to(p.device, p.dtype))

    @torch.no_grad()
    def set_(self, params: Mapping[str, torch.Tensor], segment: int, values: torch.Tensor) -> None:
        """params[segment] = values (in place)."""
        for n, idx, part in self._split(segment, values):
            p = params[n]
            p.view(-1).index_put_((idx.to(p.device),), part.to(p.device, p.dtype))


def weighted_average(values: Sequence[torch.Tensor], weights: Sequence[float]) -> Optional[torch.Tensor]:
    """Average weighted by samples processed since the last round; None when every weight is zero.

    A weight-0 peer (sync phase) contributes nothing, so it absorbs the consensus without moving it.
    """
    if len(values) != len(weights):
        raise ValueError("one weight per value")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative")
    total = float(sum(weights))
    if total <= 0:
        return None
    out = torch.zeros_like(values[0], dtype=torch.float32)
    for v, w in zip(values, weights):
        if w:
            out.add_(v.float(), alpha=w / total)
    return out


def sparta_update(current: torch.Tensor, snapshot: torch.Tensor, average: torch.Tensor,
                  delta_rule: bool = True) -> torch.Tensor:
    """The change to apply to a segment when its round completes.

    Delta rule (report eq. 8): theta <- theta + (avg - snapshot), keeping the local progress made
    since the snapshot; without it, theta <- avg (the returned change is avg - theta).
    """
    return (average - snapshot) if delta_rule else (average - current)


def apply_round(params: Mapping[str, torch.Tensor], tiling: SegmentTiling, segment: int,
                snapshot: torch.Tensor, average: Optional[torch.Tensor], delta_rule: bool = True,
                averaged: Optional[torch.Tensor] = None) -> None:
    """Apply a finished averaging round in place; a missing average (round failed) changes nothing.

    `averaged` (bool, one per segment value) marks the values whose average came back; the others
    keep their local values (report §3.3.1.8: a slice that does not return is not applied).
    """
    if average is None:
        return
    current = tiling.gather(params, segment) if not delta_rule else snapshot
    update = sparta_update(current, snapshot, average, delta_rule)
    if averaged is not None:
        update = torch.where(averaged, update, torch.zeros_like(update))
    tiling.add_(params, segment, update)


def round_summary(records: list[dict]) -> dict[str, Any]:
    """Per-stage averaging health from the round records of its workers (report §5.7.1).

    ``averaging_rounds``: distinct rounds some worker completed (whole or partial);
    ``reduce_success_mean``: over reducers' records; ``averaging_success_mean``: over rounds that
    ran (a failed round counts 0; skipped and empty rounds are left out); ``bytes_per_round``:
    mean bytes sent + received by a worker in a completed round; ``rounds_failed``: failed records.
    """
    ran = [r for r in records if r.get("status") in ("complete", "partial", "failed")]
    done = [r for r in ran if r["status"] != "failed"]
    reduce = [r["reduce_success"] for r in done if r.get("reduce_success") is not None]
    moved = [r["bytes_sent"] + r["bytes_received"] for r in done]
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)
    return {
        "averaging_rounds": len({r["round"] for r in done}),
        "reduce_success_mean": mean(reduce),
        "averaging_success_mean": mean([r["averaging_success"] for r in ran]),
        "bytes_per_round": mean(moved),
        "rounds_failed": len(ran) - len(done),
    }
