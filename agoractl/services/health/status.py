"""``agoractl status``: a live summary of a run from the Health Monitor's database: stages (serving replicas,
phases, step), nodes present, trainers' samples and loss, tokens per second, active alerts."""

from __future__ import annotations

import time

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from agoractl.services.health.models import Alert, Contribution, Flagged, Presence, Snapshot, TrainerSession

RATE_WINDOW_S = 60.0
"""Tokens per second are measured over the snapshots of the last minute."""


def summary(engine: Engine, run: str) -> dict:
    """RUN's summary (its metadata.name: the database may hold several runs)."""
    with Session(engine) as s:
        last = s.scalars(select(Snapshot).where(Snapshot.run == run).order_by(Snapshot.id.desc()).limit(1)).first()
        if last is None:
            return {"snapshots": 0}
        first = s.scalars(select(Snapshot).where(Snapshot.run == run, Snapshot.at >= last.at - RATE_WINDOW_S)
                          .order_by(Snapshot.id).limit(1)).first()
        flagged = set(s.scalars(select(Flagged.subject)))
        sessions = [r for r in s.scalars(select(TrainerSession).where(TrainerSession.run == run))
                    if r.key not in flagged]
        present = s.scalars(select(Presence).where(Presence.run == run, Presence.left_at.is_(None))).all()
        left = s.scalar(select(func.count()).select_from(Presence).where(Presence.run == run,
                                                                                   Presence.left_at.is_not(None)))
        alerts = s.scalars(select(Alert).where(Alert.run == run, Alert.resolved_at.is_(None))
                           .order_by(Alert.raised_at)).all()
        flops = s.scalar(select(func.coalesce(func.sum(Contribution.flops), 0.0)).where(Contribution.run == run))
        span = last.at - first.at
        rate = (last.data.get("tokens", 0) - first.data.get("tokens", 0)) / span if span > 0 else 0.0
        samples = sum(r.loss_samples for r in sessions)
        return {
            "snapshots": s.scalar(select(func.count()).select_from(Snapshot).where(Snapshot.run == run)),
            "at": last.at, "age_s": round(time.time() - last.at, 1),
            "stages": last.data.get("stages", {}),
            "nodes": {"workers": sum(1 for p in present if p.kind == "worker"),
                      "trainers": sum(1 for p in present if p.kind == "trainer"), "left": left},
            "step": max((st.get("step", 0) for st in last.data.get("stages", {}).values()), default=0),
            "samples": sum(r.completed for r in sessions),
            "loss": sum(r.loss_sum for r in sessions) / samples if samples else None,
            "recent_loss": _mean([r.loss for r in sessions if r.loss is not None and not r.done]),
            "tokens_per_s": round(rate, 1),
            "flops": flops,
            "flagged": sorted(flagged),
            "alerts": [{"kind": a.kind, "subject": a.subject, "stage": a.stage, "detail": a.detail,
                        "raised_at": a.raised_at} for a in alerts],
        }


def _mean(xs):
    return sum(xs) / len(xs) if xs else None
