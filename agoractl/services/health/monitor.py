"""The Health Monitor's interval: read the run's DHT records, write what they say to the database, run the
checks (:mod:`.checks`), raise and resolve alerts (a database row and a log line each).

Progress is counted once: a trainer's report carries its session (one per trainer process) and a sequence
number, and its counts are cumulative within the session; the database keeps each session's newest counted
report, and a report whose number is not newer is discarded, so a monitor restarted mid-run (its database
intact) neither loses nor double-counts anything. A report that fails its owner-signature check is never
counted; its key (or claimed peer) is flagged, and sessions signed by a flagged key are left out of the
aggregates.

FLOPs contributed per worker: samples it trained (its own cumulative count, in its record) x its stage's
``flops_per_sample`` from ``manifest plan`` (model FLOPs: the forward that the worker's backward recomputes
is not counted).

Every row it writes and reads is its run's (``metadata.name``): several runs may share one database.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from agoractl import logs
from agoractl.manifest.plan import stage_flops_per_sample
from agoractl.manifest.schema import Run
from agoractl.services.health import checks
from agoractl.services.health.checks import Condition, Reading
from agoractl.services.health.models import (Alert, Contribution, Flagged, Presence, PresenceEvent, Snapshot,
                                             TrainerKey, TrainerSession)


def read(records, stages: list[str], admitted: Optional[Callable[[], Optional[dict]]] = None) -> Reading:
    """One reading through a :class:`~agoractl.runtime.records.RunRecords`."""
    workers = {s: records.stage_workers(s) for s in stages}
    return Reading(at=time.time(), workers=workers, trainers=records.trainer_reports(),
                   admitted=admitted() if admitted else None)


class Monitor:
    """Writes readings to the database. One per run; `tick` is called every ``monitoring.interval_s``."""

    def __init__(self, run: Run, engine: Engine) -> None:
        self.run, self.engine = run, engine
        self.stages = run.stage_names()
        self.flops = {s: stage_flops_per_sample(run, i) for i, s in enumerate(self.stages)}
        self.log = logs.get("health")
        self.name = run.metadata.name
        self._adopt()
        self._completed = -1
        self._last_progress = time.time()

    def tick(self, reading: Reading) -> list[Condition]:
        """Write READING; returns the conditions that hold now (each an active alert)."""
        now = reading.at
        with Session(self.engine) as s:
            conditions = checks.announcers(reading)
            conditions += checks.replicas(reading, self.stages, self.run.monitoring.min_replicas)
            conditions += self._progress(s, reading)
            seen = self._presence(s, reading)
            self._contributions(s, reading)
            totals = self._totals(s)
            began, finished = totals["sessions"] > 0, totals["sessions"] > 0 and totals["all_done"]
            if totals["completed"] != self._completed:
                self._completed, self._last_progress = totals["completed"], now
            conditions += checks.stalled(now, self._last_progress, self.run.monitoring.stall_after_s, began, finished)
            s.add(Snapshot(run=self.name, at=now, data={"stages": {st: {
                "workers": len(reading.workers.get(st, {})), "serving": checks.serving(reading.workers.get(st, {})),
                "phases": _count(r.phase for r in reading.workers.get(st, {}).values()),
                "step": max((r.step for r in reading.workers.get(st, {}).values()), default=0)}
                for st in self.stages}, "nodes": seen, **{k: v for k, v in totals.items() if k != "all_done"}}))
            self._alerts(s, conditions, now)
            s.commit()
        return conditions

    def _adopt(self) -> None:
        """Rows written before the database named runs (schema h0002: run '') are this run's."""
        with Session(self.engine) as s:
            for table in (Snapshot, Presence, PresenceEvent, TrainerKey, TrainerSession, Contribution, Alert):
                s.execute(update(table).where(table.run == "").values(run=self.name))
            s.commit()

    # -- pieces of a tick -------------------------------------------------------------------------------

    def _progress(self, s: Session, reading: Reading) -> list[Condition]:
        out = []
        for index, (rec, verified) in sorted(reading.trainers.items()):
            known = s.get(TrainerKey, (self.name, index))
            bad = checks.forgery(index, rec, verified, known.key if known else None)
            if bad is not None:
                out.append(bad)
                if s.get(Flagged, bad.subject) is None:
                    s.add(Flagged(subject=bad.subject, reason=bad.detail[:256], at=reading.at))
                continue
            if s.get(Flagged, rec.key) is not None or not rec.session:
                continue
            if known is None:
                s.add(TrainerKey(run=self.name, trainer=index, key=rec.key, at=reading.at))
            row = s.get(TrainerSession, (index, rec.session))
            if row is None:
                row = TrainerSession(run=self.name, trainer=index, session=rec.session, key=rec.key, peer=rec.peer,
                                     seq=0, first_at=reading.at, updated_at=reading.at)
                s.add(row)
            if rec.seq <= row.seq:
                continue  # counted already (a repeat read, or an older report)
            row.seq, row.completed, row.lost = rec.seq, rec.completed, rec.lost
            row.loss_sum, row.loss_samples, row.loss = rec.loss_sum, rec.loss_samples, rec.loss
            row.tail_step, row.tokens, row.done = rec.tail_step, sum(int(v) for v in rec.tokens.values()), rec.done
            row.updated_at = reading.at
        s.flush()
        return out

    def _presence(self, s: Session, reading: Reading) -> int:
        now, seen = reading.at, {}
        for stage, records in reading.workers.items():
            for peer, r in records.items():
                seen[peer] = ("worker", stage, r.role, r.phase)
        for rec, verified in reading.trainers.values():
            if verified and rec.peer and not rec.done and s.get(Flagged, rec.key) is None:
                seen[rec.peer] = ("trainer", None, "", "")
        for node, (kind, stage, role, phase) in seen.items():
            row = s.get(Presence, node)
            if row is None:
                s.add(Presence(run=self.name, node=node, kind=kind, stage=stage, role=role, phase=phase, first_seen=now,
                               last_seen=now))
                s.add(PresenceEvent(run=self.name, node=node, kind=kind, stage=stage, event="joined", at=now))
                self.log.info("node joined", node=node, kind=kind, stage=stage)
                continue
            if row.left_at is not None:
                row.left_at = None
                s.add(PresenceEvent(run=self.name, node=node, kind=kind, stage=stage, event="joined", at=now))
            row.last_seen, row.stage, row.role, row.phase = now, stage, role, phase
        for row in s.scalars(select(Presence).where(Presence.run == self.name, Presence.left_at.is_(None))):
            if row.node not in seen:
                row.left_at = now
                s.add(PresenceEvent(run=self.name, node=row.node, kind=row.kind, stage=row.stage, event="left",
                                    at=now))
                self.log.info("node left", node=row.node, kind=row.kind, stage=row.stage, last_seen=row.last_seen)
        return len(seen)

    def _contributions(self, s: Session, reading: Reading) -> None:
        for stage, records in reading.workers.items():
            for peer, r in records.items():
                row = s.get(Contribution, peer)
                if row is None:
                    row = Contribution(run=self.name, node=peer, stage=stage, role=r.role, samples=0, flops=0.0,
                                       updated_at=reading.at)
                    s.add(row)
                if r.samples > row.samples:
                    row.samples, row.stage, row.updated_at = r.samples, stage, reading.at
                    row.flops = float(r.samples * self.flops.get(stage, 0))

    def _totals(self, s: Session) -> dict:
        flagged = set(s.scalars(select(Flagged.subject)))
        rows = [r for r in s.scalars(select(TrainerSession).where(TrainerSession.run == self.name))
                if r.key not in flagged]
        return {"sessions": len(rows), "completed": sum(r.completed for r in rows),
                "loss_sum": sum(r.loss_sum for r in rows), "loss_samples": sum(r.loss_samples for r in rows),
                "tokens": sum(r.tokens for r in rows), "all_done": bool(rows) and all(r.done for r in rows)}

    def _alerts(self, s: Session, conditions: list[Condition], now: float) -> None:
        active = {(a.kind, a.subject): a for a in s.scalars(select(Alert).where(Alert.run == self.name,
                                                                               Alert.resolved_at.is_(None)))}
        holding = {(c.kind, c.subject): c for c in conditions}
        for key, c in holding.items():
            if key not in active:
                s.add(Alert(run=self.name, kind=c.kind, subject=c.subject, stage=c.stage, detail=c.detail[:512],
                            raised_at=now))
                self.log.warning("alert", kind=c.kind, subject=c.subject, stage=c.stage, detail=c.detail)
        for key, a in active.items():
            if key not in holding:
                a.resolved_at = now
                self.log.info("alert resolved", kind=a.kind, subject=a.subject)


def _count(values) -> dict:
    out: dict = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out
