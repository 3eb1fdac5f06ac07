"""Fault injection through the DHT (report §3.5.3.1): preemption signals for the next averaging round.

An operator attaches a temporary node to the run's DHT and writes a signal under
``<run>.<stage>.faults`` (subkey: the signal id, short expiry): which workers of the stage
(``targets``, peer ids) exit, and at which point of their next SPARTA round (``during``: ``send``
after their first chunk went out, or ``reduce`` as a reducer, holding its first reduced chunk).
Workers read the key when a round starts; a targeted worker arms the fault for that round and
dies there (:mod:`agoractl.runtime.averaging`), every other worker ignores the signal.

The targets are chosen when the signal is written, from the stage's live worker records, so the
count is exact and the command can say who it hit: ``reduce`` only hits operators (contributors
never reduce); ``send`` hits any role unless one is asked for.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

from agoractl.runtime.records import DHT_REPLICAS

FAULT_POINTS = ("send", "reduce")


def faults_key(run: str, stage: str) -> str:
    return f"{run}.{stage}.faults"


@dataclass
class PreemptSignal:
    """Preempt `targets` (peer ids) during the next averaging round, at `during`."""

    during: str
    targets: list[str]
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    issued: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Optional["PreemptSignal"]:
        if not isinstance(d, dict) or d.get("during") not in FAULT_POINTS or not isinstance(d.get("targets"), list):
            return None
        return cls(during=d["during"], targets=[str(t) for t in d["targets"]], id=str(d.get("id", "")),
                   issued=float(d.get("issued", 0.0)))


def eligible(workers: Iterable[Any], during: str, role: Optional[str] = None) -> list[str]:
    """Peer ids that a `during` preemption may hit among `workers` (records with peer, role, phase):
    reducers only for ``reduce``; `role` narrows the choice further."""
    if during not in FAULT_POINTS:
        raise ValueError(f"during must be one of {FAULT_POINTS}; got {during!r}")
    out = []
    for w in workers:
        if during == "reduce" and w.role != "operator":
            continue
        if role is not None and w.role != role:
            continue
        out.append(w.peer)
    return sorted(out)


def choose_targets(candidates: list[str], count: int, seed: Optional[int] = None) -> list[str]:
    """`count` of `candidates` at random (all of them when there are fewer)."""
    if count < 1:
        raise ValueError(f"count must be positive; got {count}")
    return sorted(random.Random(seed).sample(sorted(candidates), min(count, len(candidates))))


def write_signal(dht, run: str, stage: str, signal: PreemptSignal, ttl_s: float, timeout_s: float = 30.0) -> bool:
    """Store `signal` in the DHT (blocking); True when stored."""
    from hivemind.utils import get_dht_time

    return bool(dht.store(faults_key(run, stage), signal.to_dict(), get_dht_time() + ttl_s, subkey=signal.id,
                          return_future=True, beam_size=DHT_REPLICAS).result(timeout_s))


def read_signals(dht, run: str, stage: str, timeout_s: float = 10.0) -> list[PreemptSignal]:
    """The stage's unexpired preemption signals (blocking)."""
    found = dht.get(faults_key(run, stage), latest=True, return_future=True, beam_size=DHT_REPLICAS).result(timeout_s)
    if found is None or not isinstance(found.value, dict):
        return []
    out = []
    for entry in found.value.values():
        sig = PreemptSignal.from_dict(getattr(entry, "value", None))
        if sig is not None:
            out.append(sig)
    return sorted(out, key=lambda s: s.issued)

