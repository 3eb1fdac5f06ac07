"""The data-parallel interface of a worker (report §3.3.1.7, §4.2; seed 002): one averaging transport,
two methods on top of it.

- :class:`AveragingTransport` moves one flat tensor among the replicas of a stage, in the background:
  :meth:`~AveragingTransport.begin_round` returns a :class:`PendingAverage` whose result is the
  weighted average, which of the values came back averaged, and a :class:`RoundRecord`. The real one
  is :class:`agoractl.runtime.averaging.StageAverager` (hivemind), built by the worker node and
  injected; tests use an in-memory one.
- :class:`DataParallelMethod` is what the worker node drives, whatever the method:
  ``join(stage_step)``, ``start()``, ``summary()``, ``shutdown()``. SPARTA
  (:class:`agoractl.training.sparta_rounds.SpartaRounds` under
  :class:`agoractl.runtime.sparta_worker.SpartaWorker`) and FGDiLoCo
  (:class:`agoractl.training.fgdiloco_rounds.FGDiLoCoRounds` under
  :class:`agoractl.runtime.fgdiloco_worker.FGDiLoCoNode`) both implement it over the same transport.
- :class:`StageView`: how many replicas of the stage are alive (the runtime reads it from the DHT).

No networking here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Protocol

import torch

from agoractl.manifest.schema import Run


@dataclass
class RoundRecord:
    """One averaging round as this peer saw it (report §5.7.1). Fractions in [0, 1]; None = not measured.

    status: ``complete`` (every value came back averaged), ``partial``, ``failed`` (no group, a
    timeout, an error, or nothing came back), ``empty`` (every peer of the group had weight 0:
    nothing to average, everyone keeps its values), ``skipped`` (not attempted: no other replica, or
    none in this round). reduce_success is measured by reducers only.
    """

    round: int
    segment: int
    status: str
    group_size: int = 0
    reducers: int = 0
    weight: float = 0.0
    group_weight: float = 0.0
    reduce_success: Optional[float] = None
    averaging_success: float = 0.0
    matchmaking_s: Optional[float] = None
    duration_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    dropped_parts: int = 0
    """Groupmates' parts this peer, as a reducer, dropped as invalid (non-finite or absurd)."""
    snapshot_sum: Optional[float] = None
    """Sum of the values this peer sent (its snapshot of the segment)."""
    average_sum: Optional[float] = None
    """Sum of the averaged values it got back (where they came back): the same at every replica."""
    grouped: bool = False
    """Matchmaking formed a group and its all-reduce began (False: no partner met this peer in the round)."""
    error: Optional[str] = None

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class PendingAverage(Protocol):
    """One round running in the background; poll :meth:`done`, then take :meth:`result` once."""

    round: int
    segment: int

    def done(self) -> bool: ...

    def looking(self) -> bool:
        """Still looking for a group (nothing sent yet): :meth:`cancel` ends it at once (SPARTA's transport)."""

    def result(self, timeout: Optional[float] = None) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor],
                                                               RoundRecord]:
        """(average, averaged mask, record). The average is None when nothing came back; values whose
        mask is False did not come back and keep their local values."""

    def cancel(self) -> None:
        """Give up on the round (shutdown; a SPARTA round nobody else will come to)."""


class AveragingTransport(Protocol):
    """Averages one flat tensor with the other replicas of a stage (see the module docstring)."""

    round_deadline_s: float
    """The longest a round can last before its result says it failed."""

    def begin_round(self, round_index: int, segment: int, values: torch.Tensor, weight: float,
                    expected_peers: int, fault: Optional[str] = None) -> PendingAverage:
        """Start averaging `values` in the background, weighted by `weight` (0: absorb only);
        `expected_peers` replicas of the stage (this one included) are believed alive; `fault`
        (``send`` / ``reduce``) preempts this worker at that point of the round."""

    def shutdown(self) -> None: ...


class StageView(Protocol):
    """The live replicas of this worker's stage."""

    live: int
    """Replicas seen within a record's lifetime, this worker included."""
    serving_others_now: int
    """Other replicas in the latest read that serve (past weight sync)."""
    rounds_now: dict[str, int]
    """The SPARTA round each other serving replica of the latest read announced it is averaging."""

    def seen_in_round(self, round_index: int) -> set[str]:
        """The other serving replicas seen averaging round `round_index`."""


class DataParallelMethod(Protocol):
    """What the worker node drives: create after the Worker, :meth:`join`, :meth:`start`, and at exit
    :meth:`summary` (into the worker's final stats) and :meth:`shutdown`."""

    def join(self, stage_step: int) -> dict[str, Any]:
        """Load the stage's state if the stage already trained; returns how (source, loaded step...)."""

    def start(self) -> None: ...

    def summary(self) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...


def transport_capacity(run: Run, module: torch.nn.Module) -> int:
    """Values the stage's averaging transport must hold in one round: SPARTA's largest segment
    (:meth:`~agoractl.algorithms.sparta.SegmentTiling.max_size`, without building the tiling), or
    every trainable value for FGDiLoCo."""
    numels = [int(p.numel()) for p in module.parameters() if p.requires_grad]
    if run.data_parallel.method == "sparta":
        segments = run.n_segments()
        return sum(-(-k // segments) for k in numels)
    return sum(numels)
