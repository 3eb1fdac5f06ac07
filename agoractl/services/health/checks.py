"""The Health Monitor's checks (report §3.6.2), as pure functions of one interval's reading: each returns the
conditions that hold now; the monitor raises an alert when a condition begins and resolves it when it ends.

- ``unadmitted_announcer``: a worker record whose peer the Authorizer has not admitted (admission on);
- ``wrong_stage_announcer``: a worker announcing another stage than the one it was given (admission on);
- ``stage_below_minimum``: fewer serving replicas (optimizer_sync or active) than ``monitoring.min_replicas``;
- ``forged_report``: a trainer record whose owner signature does not verify, or signed by another key than
  the one its trainer index first reported with (trust on first use);
- ``progress_stalled``: no new completed sample for ``monitoring.stall_after_s`` once training began.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from agoractl.runtime.records import SERVING_PHASES, TrainerRecord, WorkerRecord

KINDS = ("unadmitted_announcer", "wrong_stage_announcer", "stage_below_minimum", "forged_report",
         "progress_stalled")


@dataclass(frozen=True)
class Condition:
    kind: str
    subject: str
    stage: Optional[str] = None
    detail: str = ""


@dataclass
class Reading:
    """One interval's read of the run's records."""

    at: float
    workers: dict[str, dict[str, WorkerRecord]]
    """{stage: {peer: record}}."""
    trainers: dict[int, tuple[TrainerRecord, bool]] = field(default_factory=dict)
    """{trainer index: (record, its signature verifies)}."""
    admitted: Optional[dict[str, Optional[str]]] = None
    """Admission on: {peer id: stage given (None for trainers)} of the admitted nodes; None when off."""


def announcers(reading: Reading) -> list[Condition]:
    if reading.admitted is None:
        return []
    out = []
    for stage, records in reading.workers.items():
        for peer in records:
            if peer not in reading.admitted:
                out.append(Condition("unadmitted_announcer", peer, stage,
                                     f"peer {peer} announces stage {stage} without being admitted"))
            elif reading.admitted[peer] != stage:
                out.append(Condition("wrong_stage_announcer", peer, stage,
                                     f"peer {peer} was given stage {reading.admitted[peer]} and announces {stage}"))
    return out


def serving(records: dict[str, WorkerRecord]) -> int:
    return sum(1 for r in records.values() if r.phase in SERVING_PHASES)


def replicas(reading: Reading, stages: list[str], minimum: int) -> list[Condition]:
    out = []
    for stage in stages:
        n = serving(reading.workers.get(stage, {}))
        if n < minimum:
            out.append(Condition("stage_below_minimum", stage, stage,
                                 f"stage {stage} has {n} serving replica(s), below its minimum of {minimum}"))
    return out


def forgery(index: int, record: TrainerRecord, verified: bool, known_key: Optional[str]) -> Optional[Condition]:
    """A forged report's condition (subject: the key it names, else its claimed peer), or None for a good one."""
    subject = record.key or record.peer or f"trainer-{index}"
    if not verified:
        return Condition("forged_report", subject, None,
                         f"trainer {index} report (peer {record.peer}) does not verify under the key it names")
    if known_key is not None and record.key != known_key:
        return Condition("forged_report", subject, None,
                         f"trainer {index} report (peer {record.peer}) is signed by another key than trainer "
                         f"{index}'s")
    return None


def stalled(now: float, last_progress_at: float, stall_after_s: float, began: bool, finished: bool) -> list[Condition]:
    if began and not finished and now - last_progress_at > stall_after_s:
        return [Condition("progress_stalled", "run", None,
                          f"no new completed sample for {now - last_progress_at:.0f} s")]
    return []
