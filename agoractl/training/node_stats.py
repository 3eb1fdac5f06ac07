"""A node's final statistics: one typed definition for the process that writes them and the code that
reads them.

Workers and trainers write theirs as JSON on exit (``--stats``; :mod:`agoractl.runtime.worker_node`,
:mod:`agoractl.runtime.trainer`); ``launch swarm`` reads them back (:mod:`agoractl.runtime.swarm`),
aggregates them into the run report (:mod:`agoractl.training.swarm_report`) and lists each node's
summary in it. Both sides go through these dataclasses, so a field renamed on one side fails where it
is written (``TypeError``: unexpected keyword) or read (``ValueError`` naming the field), instead of
silently becoming 0 or None in the report.

A node's summary in the run report is every field except those marked :data:`DETAIL` (per-step and
per-round records, process bookkeeping), which stay in the node's own stats file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional, TypeVar

T = TypeVar("T")
FINISHED_REASONS = ("max_steps reached", "until_step reached")
"""A trainer's ``finished_reason`` when the stages reached the launch's last step (without / with
``training.until_step``)."""

DETAIL = {"detail": True}
"""Field metadata: kept in the node's stats file, left out of its summary in the run report."""


def _from_dict(cls: type[T], d: dict, what: str) -> T:
    if not isinstance(d, dict):
        raise ValueError(f"{what} statistics are a JSON {type(d).__name__}, not an object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{what} statistics have unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    return cls(**d)


def summary(stats: Any) -> dict[str, Any]:
    """The fields of `stats` that the run report lists for its node (all but :data:`DETAIL` ones)."""
    return {f.name: getattr(stats, f.name) for f in fields(stats) if not f.metadata.get("detail")}


@dataclass
class WorkerStats:
    """A worker's compute counters, kept as it serves (its DHT record publishes some of them)."""

    forward_samples: int = 0
    backward_samples: int = 0
    batches: dict = field(default_factory=lambda: {"forward": 0, "backward": 0, "forward_backward": 0})
    max_coalesced: int = 0
    coalesced_sum: int = 0
    compute_s: float = 0.0
    compute_cpu_s: float = 0.0
    """CPU seconds (thread time) of the compute thread in `compute_s`: below it, the process waited for a core."""
    idle_s: float = 0.0
    failed_batches: int = field(default=0, metadata=DETAIL)
    refused: int = 0
    """Requests refused before compute: non-finite or malformed inputs (validation.enabled)."""
    finished_replies: int = 0
    """Requests answered "finished" untrained: the replica, stepping on its own count, took its last step."""
    waiting_replies: int = 0
    """Requests answered "waiting" untrained: the replica, stepping on its own count, was in a blocking mix."""
    checks_s: float = 0.0
    """CPU seconds (thread time) the worker spent checking requests (validation.enabled): what the checks cost."""
    steps: list = field(default_factory=list, metadata=DETAIL)
    """[step, wall time, samples contributed, grad norm before clipping] per optimizer step taken."""
    first_request: Optional[float] = None
    """Wall-clock time of the first request served."""
    cache: Optional[dict] = None
    """The activation cache's counters (hits, misses, evicted, stale, peak_mb, limit_mb); None when off."""


@dataclass
class WorkerNodeStats(WorkerStats):
    """A worker's final statistics: its compute counters, where it ran, its data-parallel rounds, and
    CPU seconds (``{"node", "dht", "p2pd"}``) at exit, at "worker ready" and at its first request.
    A worker killed before it wrote them is represented by its last DHT record (``killed``)."""

    kind: str = field(default="worker", metadata=DETAIL)
    peer: str = ""
    stage: str = ""
    pid: int = field(default=0, metadata=DETAIL)
    phase: str = "active"
    role: str = "operator"
    step: int = 0
    """Optimizer steps the worker's stage had taken when it left."""
    started: Optional[float] = None
    announced: Optional[float] = field(default=None, metadata=DETAIL)
    dht_calls: dict = field(default_factory=dict, metadata=DETAIL)
    """{call: [count, seconds]} of the node's DHT calls."""
    throughput: float = 0.0
    termination: Optional[dict] = None
    """The self-termination rule that fired (rule, exit_code, message), if one did."""
    rounds: list = field(default_factory=list, metadata=DETAIL)
    """Data-parallel round records (SPARTA rounds or FGDiLoCo mixes)."""
    phases: Optional[list] = None
    join: Optional[dict] = None
    sparta: Optional[dict] = None
    fgdiloco: Optional[dict] = None
    cpu_s: Optional[dict] = None
    cpu_at_ready_s: Optional[dict] = None
    cpu_at_first_request_s: Optional[dict] = None
    peak_rss_mb: Optional[float] = None
    """The worker process's peak resident memory (its DHT process and p2pd not included)."""
    resumed: Optional[dict] = None
    """What the worker resumed from (a checkpoint or a peer's state), if it did."""
    admission: Optional[dict] = field(default=None, metadata=DETAIL)
    progress_push: Optional[dict] = None
    """Progress pushed to and taken from the stage's other replicas (:mod:`agoractl.runtime.progress_push`):
    ``sent``, ``failed``, ``received``, ``refused``."""
    killed: bool = False
    feed: Optional[dict] = field(default=None, metadata=DETAIL)
    """A self-fed replica's feeder statistics (``workers.self_feed``), a :class:`TrainerNodeStats` as a dict."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "WorkerNodeStats":
        return _from_dict(cls, d, "worker")


@dataclass
class TrainerStageStats:
    """A trainer's counters for one stage."""

    retries: int = 0
    """Requests re-sent to another replica after a failure (forward retries and backward fallbacks)."""
    backward_fallbacks: int = 0
    """Backward passes served by a replica other than the one that ran the forward."""
    route_fallbacks: int = 0
    """Requests of replicas on their own counts sent elsewhere than their assigned replica while it still trained
    (:class:`~agoractl.algorithms.routing.ReplicaRoute`: it was banned, failed the request, or was held too long);
    not those of a replica past its last step."""
    failures: int = 0
    """Failed calls (errors and timeouts)."""
    rejected: int = 0
    """Replies rejected as invalid (non-finite, malformed or absurd values) and counted as their workers' faults;
    not those rejected only because their input was (nobody's fault)."""
    bans: int = 0
    """Replicas the stage's balancer banned."""
    workers_seen: list = field(default_factory=list)
    """Peer ids of the stage's workers this trainer sent work to."""


@dataclass
class TrainerNodeStats:
    """A trainer's final statistics."""

    trainer: int = 0
    peer: str = ""
    kind: str = field(default="trainer", metadata=DETAIL)
    pid: int = field(default=0, metadata=DETAIL)
    dispatched: int = 0
    completed: int = 0
    lost: int = 0
    lost_at: dict = field(default_factory=dict)
    """Lost samples per (stage, direction), e.g. {"body-1/backward": 1}."""
    loss: dict = field(default_factory=dict, metadata=DETAIL)
    """{tail step (a string in JSON): [loss sum, samples]}: the loss curve, by the step the tail
    counted the sample toward."""
    loss_sum: float = field(default=0.0, metadata=DETAIL)
    """Sum of every per-sample loss above, accumulated as they arrived (what the trainer's signed DHT reports
    carry, so the Health Monitor's totals can be compared exactly)."""
    loss_samples: int = field(default=0, metadata=DETAIL)
    """Samples in loss_sum."""
    session: str = field(default="", metadata=DETAIL)
    """The session its DHT reports were numbered under."""
    sequences: list = field(default_factory=list)
    """[shard, epoch, token offset, tail step] per completed sequence (trainers.record_sequences)."""
    first_dispatch: Optional[float] = None
    last_completion: Optional[float] = field(default=None, metadata=DETAIL)
    finished_reason: str = ""
    stages: dict = field(default_factory=dict, metadata=DETAIL)
    """{stage: TrainerStageStats}."""
    faults: dict = field(default_factory=dict, metadata=DETAIL)
    """Invalid replies per worker peer (validation.enabled)."""
    checks_s: float = 0.0
    """CPU seconds (thread time) the trainer spent checking replies (validation.enabled): what the checks cost."""
    seen_step: dict = field(default_factory=dict, metadata=DETAIL)
    tokens: dict = field(default_factory=dict, metadata=DETAIL)
    """{shard (a string in JSON): tokens consumed}."""
    cpu_s: Optional[dict] = None
    cpu_at_start_s: Optional[dict] = None
    resumed: Optional[Any] = None
    """Where the trainer's data stream resumed, if it did."""
    admission: Optional[dict] = field(default=None, metadata=DETAIL)

    def __post_init__(self):
        self.stages = {s: c if isinstance(c, TrainerStageStats) else _from_dict(TrainerStageStats, c, f"trainer stage {s}")
                       for s, c in self.stages.items()}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["loss"] = {str(k): v for k, v in sorted(self.loss.items())}
        d["tokens"] = {str(k): int(v) for k, v in self.tokens.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainerNodeStats":
        return _from_dict(cls, d, "trainer")


@dataclass(frozen=True)
class LostTrainer:
    """A trainer that died without writing its statistics: its last DHT record's in-flight samples."""

    trainer: int
    in_flight: int = 0
