"""The run's records in the DHT (report §3.3.1.5, §3.3.2.2): keys, record shapes, reads and writes.

Every key starts with the run name (``metadata.name``), so several runs can share one DHT. Each
record lives under a subkey (the writer's peer id or trainer index) with a short expiry, so a node
that stops refreshing its record disappears from every reader's view on its own:

- ``<run>.<stage>.workers``: one :class:`WorkerRecord` per live worker of the stage, re-announced
  by a thread every ``workers.announce_period_s`` (expiry: three periods). Carries the worker's
  ``phase`` (``weight_sync`` is invisible to trainers; ``optimizer_sync`` and ``active`` serve),
  ``role`` (operator or contributor), step and throughput.
- ``<run>.<stage>.progress``: ``{step, total}`` per replica (its step and cumulative samples), the
  stage's collective progress toward the global batch (:mod:`agoractl.algorithms.progress`).
- ``<run>.trainers``: one :class:`TrainerRecord` per trainer: loss, samples, tokens per shard. Owner-signed:
  the trainer signs each record with its node key (:mod:`agoractl.auth.node_key`) and numbers it (``session``,
  ``seq``), so the Health Monitor counts each report once and flags one that does not verify.

Values are plain dicts (msgpack); readers tolerate missing or extra fields (other versions).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from agoractl.algorithms.progress import PeerProgress

PHASES = ("weight_sync", "optimizer_sync", "active")
"""Worker phases (report §3.3.1.1): weight sync is invisible to trainers, the other two serve."""
SERVING_PHASES = ("optimizer_sync", "active")
ROLES = ("operator", "contributor")


DHT_REPLICAS = 5
"""Nodes that hold each record (hivemind's ``num_replicas``, its default), and the beam of the searches
for them: a store goes to the key's DHT_REPLICAS nearest nodes, and a read that visits those nodes
finds every subkey. hivemind's searches keep ``bucket_size`` (20) nodes in the beam by default — in a
swarm of fewer nodes, every one of them, on every read and write; the run's records are read and
written several times a second."""


def get_dht_time() -> float:
    """hivemind's clock (imported on use: hivemind pulls in torch, and this module is imported early)."""
    from hivemind.utils import get_dht_time as now

    return now()


def workers_key(run: str, stage: str) -> str:
    return f"{run}.{stage}.workers"


def progress_key(run: str, stage: str) -> str:
    return f"{run}.{stage}.progress"


def trainers_key(run: str) -> str:
    return f"{run}.trainers"


def _from_dict(cls, d: Any):
    if not isinstance(d, dict):
        return None
    known = {f.name for f in fields(cls)}
    try:
        return cls(**{k: v for k, v in d.items() if k in known})
    except TypeError:
        return None


@dataclass
class WorkerRecord:
    """A worker's announcement: who it is, which stage, its phase, how far and how fast."""

    peer: str
    stage: str
    phase: str = "active"
    role: str = "operator"
    step: int = 0
    samples: int = 0
    """Samples whose backward this worker ran (cumulative)."""
    throughput: float = 0.0
    """Samples per second of compute (moving average); 0 until measured."""
    max_coalesced: int = 0
    queued: int = 0
    pid: int = 0
    started: float = 0.0
    """Wall-clock time (time.time()) at which the worker started."""
    first_request: Optional[float] = None
    """Wall-clock time of the first request a trainer sent it (None until then)."""
    round: Optional[int] = None
    """The SPARTA round this worker is averaging right now (None between rounds): its stage's replicas tell a
    round they missed from one they were in (:class:`~agoractl.runtime.stage_peers.StagePeers`)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Optional["WorkerRecord"]:
        return _from_dict(cls, d)


@dataclass
class TrainerRecord:
    """A trainer's published state (report §3.6.2.3's training progress, from the trainer's side)."""

    trainer: int
    peer: str = ""
    dispatched: int = 0
    completed: int = 0
    lost: int = 0
    in_flight: int = 0
    loss: Optional[float] = None
    """Mean loss of the samples completed since the previous record."""
    tail_step: int = 0
    tokens: dict = field(default_factory=dict)
    """Tokens consumed per shard ({shard: tokens}), as the data stream counts them."""
    pid: int = 0
    done: bool = False
    faults: dict = field(default_factory=dict)
    """Rejected replies per worker ({peer: {"stage": s, reason: count}}), for the Health Monitor and the
    Authorizer (a node with faults should not have its credential renewed)."""
    session: str = ""
    """Random per trainer process: a restarted trainer's counters start again under a new session."""
    seq: int = 0
    """Report number within the session (1, 2, ...): a reader counts each (session, seq) once."""
    loss_sum: float = 0.0
    """Cumulative sum of per-sample losses this session (the trainer's stats' loss sums, added up)."""
    loss_samples: int = 0
    """Samples in loss_sum."""
    key: str = ""
    """The trainer's node public key (:mod:`agoractl.auth.node_key`); empty on an unsigned record."""
    sig: str = ""
    """Ed25519 signature by `key` over every other field."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens"] = {str(k): int(v) for k, v in self.tokens.items()}
        return d

    def signed(self, key) -> dict:
        """The record as published: owner-signed with the node's private KEY."""
        from agoractl.auth import node_key

        return node_key.sign(key, {**self.to_dict(), "key": "", "sig": ""})

    @staticmethod
    def verified(d: Any) -> bool:
        """True when the raw record D carries a valid signature of the key it names."""
        from agoractl.auth import node_key

        return isinstance(d, dict) and node_key.verify(d)

    @classmethod
    def from_dict(cls, d: Any) -> Optional["TrainerRecord"]:
        return _from_dict(cls, d)


def _entries(found) -> dict[str, Any]:
    """{subkey: value} of a DHT get result (None, or a dictionary value with per-subkey expirations)."""
    if found is None or not isinstance(found.value, dict):
        return {}
    return {str(k): v.value for k, v in found.value.items() if v is not None and v.value is not None}


class RunRecords:
    """Reads and writes one run's records through a running ``hivemind.DHT``. Blocking calls (each
    bounded by `timeout_s`, TimeoutError past it): use them from threads, not from an event loop."""

    def __init__(self, dht, run_name: str, timeout_s: float = 10.0):
        self.dht, self.run, self.timeout_s = dht, run_name, timeout_s

    def _store(self, key: str, value, ttl_s: float, subkey: str, wait: bool = True):
        """True when stored; with ``wait=False`` the pending future instead (stores take a DHT traversal:
        a caller that must not block — a worker's progress — checks the future later)."""
        future = self.dht.store(key, value, get_dht_time() + ttl_s, subkey=subkey, return_future=True,
                                beam_size=DHT_REPLICAS)
        return bool(future.result(self.timeout_s)) if wait else future

    def _get(self, key: str):
        return self.dht.get(key, latest=True, return_future=True, beam_size=DHT_REPLICAS).result(self.timeout_s)

    # -- workers ------------------------------------------------------------------------------

    def announce_worker(self, record: WorkerRecord, ttl_s: float, wait: bool = True):
        return self._store(workers_key(self.run, record.stage), record.to_dict(), ttl_s, record.peer, wait)

    def withdraw_worker(self, stage: str, peer: str, timeout_s: float = 2.0) -> None:
        """Mark the worker gone at once (an explicit None), rather than waiting for expiry; waits at most
        `timeout_s` (a departing worker does not linger for the DHT: the record expires anyway)."""
        self._store(workers_key(self.run, stage), None, 60.0, peer, wait=False).result(timeout_s)

    def stage_workers(self, stage: str) -> dict[str, WorkerRecord]:
        found = self._get(workers_key(self.run, stage))
        out = {}
        for peer, value in _entries(found).items():
            rec = WorkerRecord.from_dict(value)
            if rec is not None:
                out[peer] = rec
        return out

    # -- stage progress -----------------------------------------------------------------------

    def publish_progress(self, stage: str, peer: str, step: int, total: int, ttl_s: float, wait: bool = True,
                         seen: int = 0):
        """A replica's step, cumulative samples and view of the stage's
        (:class:`~agoractl.algorithms.progress.PeerProgress`)."""
        return self._store(progress_key(self.run, stage), {"step": int(step), "total": int(total), "seen": int(seen)},
                           ttl_s, peer, wait)

    def stage_progress(self, stage: str) -> dict[str, PeerProgress]:
        found = self._get(progress_key(self.run, stage))
        out = {}
        for peer, value in _entries(found).items():
            if isinstance(value, dict) and "step" in value:
                out[peer] = PeerProgress(int(value["step"]), int(value.get("total", 0)), int(value.get("seen", 0)))
        return out

    # -- trainers -----------------------------------------------------------------------------

    def publish_trainer(self, record: TrainerRecord, ttl_s: float, key=None) -> bool:
        """Store RECORD under its trainer index; owner-signed when the node's private KEY is given."""
        value = record.signed(key) if key is not None else record.to_dict()
        return self._store(trainers_key(self.run), value, ttl_s, str(record.trainer))

    def trainers(self) -> dict[int, TrainerRecord]:
        return {i: rec for i, (rec, _) in self.trainer_reports().items()}

    def trainer_reports(self) -> dict[int, tuple[TrainerRecord, bool]]:
        """{trainer index: (record, whether its owner signature verifies)}."""
        out = {}
        for key, value in _entries(self._get(trainers_key(self.run))).items():
            rec = TrainerRecord.from_dict(value)
            if rec is not None:
                try:
                    out[int(key)] = (rec, TrainerRecord.verified(value))
                except ValueError:
                    continue
        return out
