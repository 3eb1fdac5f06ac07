"""What the Dashboard's API returns, read from the Health Monitor's database (one session per call) and, for
accounts, regions and hardware, from the Authorizer's ``nodes`` table when it shares that database.

Definitions (docs/dashboard.md):

- a **loss point** is a snapshot in which the run's counted loss samples grew; its loss is the mean loss of the
  samples counted since the previous snapshot (Δ loss_sum / Δ loss_samples), at the snapshot's time and step;
- **tokens/s** between consecutive snapshots: Δ tokens / Δ time, and over the last minute (``recent``, as
  ``agoractl status`` measures it); **efficiency** η = tokens/s / the pooled
  dense-BF16 TFLOP/s of the workers present now (report §5.4), only when every present worker's accelerator
  is in ``dashboard.accelerator_tflops``;
- a node's **status**: ``left`` (the monitor saw it leave), ``syncing`` (weight or optimizer sync),
  ``active`` (serving, or a trainer at work), ``admitted`` (the Authorizer admitted it, the DHT has not shown it
  yet; only for the dashboard's own run, whose Authorizer shares the database).
"""

from __future__ import annotations

import json
from typing import Optional

from sqlalchemy import MetaData, Table, func, inspect, select
from sqlalchemy.orm import Session

from agoractl.services.dashboard import scores
from agoractl.services.health.models import Contribution, Eval, Presence, PresenceEvent, Snapshot
from agoractl.services.health.status import RATE_WINDOW_S

SYNCING = ("weight_sync", "optimizer_sync")


def run_names(s: Session) -> list[str]:
    names = set(s.scalars(select(Snapshot.run).distinct())) | set(s.scalars(select(Presence.run).distinct()))
    return sorted(names)


def runs(s: Session) -> list[dict]:
    out = []
    for name in run_names(s):
        first, last, count = s.execute(select(func.min(Snapshot.at), func.max(Snapshot.at), func.count())
                                       .where(Snapshot.run == name)).one()
        latest = s.scalars(select(Snapshot).where(Snapshot.run == name).order_by(Snapshot.id.desc()).limit(1)).first()
        present = s.scalar(select(func.count()).select_from(Presence)
                           .where(Presence.run == name, Presence.left_at.is_(None)))
        data = latest.data if latest else {}
        out.append({"run": name, "first_at": first, "last_at": last, "snapshots": count, "step": _step(data),
                    "samples": data.get("completed", 0), "tokens": data.get("tokens", 0), "nodes_live": present})
    return out


def _snapshots(s: Session, run: str) -> list[Snapshot]:
    return list(s.scalars(select(Snapshot).where(Snapshot.run == run).order_by(Snapshot.at, Snapshot.id)))


def _step(data: dict) -> int:
    return max((st.get("step", 0) for st in data.get("stages", {}).values()), default=0)


def loss(s: Session, run: str) -> dict:
    points, prev_sum, prev_n, snaps = [], 0.0, 0, _snapshots(s, run)
    for snap in snaps:
        n, total = snap.data.get("loss_samples", 0), snap.data.get("loss_sum", 0.0)
        if n > prev_n:
            points.append({"at": snap.at, "step": _step(snap.data), "loss": (total - prev_sum) / (n - prev_n),
                           "samples": n - prev_n})
        prev_sum, prev_n = total, n
    return {"run": run, "as_of": snaps[-1].at if snaps else None, "points": points}


def authorizer_nodes(s: Session) -> dict[str, dict]:
    """{peer id: the Authorizer's row} when its ``nodes`` table is in this database (else {}). A ``region``
    column is read when the Authorizer records one."""
    conn = s.connection()
    if not inspect(conn).has_table("nodes"):
        return {}
    table = Table("nodes", MetaData(), autoload_with=conn)
    out = {}
    for row in conn.execute(select(table)).mappings():
        hardware = row.get("hardware") or {}
        if isinstance(hardware, str):  # a JSON column reflected as text
            hardware = json.loads(hardware)
        out[row["peer_id"]] = {"account": row.get("account"), "status": row.get("status"),
                               "stage": row.get("stage"), "role": row.get("role"), "region": row.get("region"),
                               "hardware": hardware}
    return out


def _status(p: Presence) -> str:
    if p.left_at is not None:
        return "left"
    return "syncing" if p.phase in SYNCING else "active"


def nodes(s: Session, run: str, own_run: str, known: Optional[dict] = None) -> dict:
    known = authorizer_nodes(s) if known is None else known
    rows = s.scalars(select(Presence).where(Presence.run == run).order_by(Presence.first_seen, Presence.node))
    out = []
    for p in rows:
        a = known.get(p.node, {})
        out.append({"node": p.node, "kind": p.kind, "stage": p.stage, "role": p.role or a.get("role") or "",
                    "phase": p.phase, "status": _status(p), "account": a.get("account"), "region": a.get("region"),
                    "accelerator": a.get("hardware", {}).get("accelerator"), "first_seen": p.first_seen,
                    "last_seen": p.last_seen, "left_at": p.left_at})
    if run == own_run:
        seen = {n["node"] for n in out}
        for peer, a in sorted(known.items()):
            if a.get("status") == "admitted" and peer not in seen:
                out.append({"node": peer, "kind": a.get("role") or "", "stage": a.get("stage"), "role": "",
                            "phase": "", "status": "admitted", "account": a.get("account"),
                            "region": a.get("region"), "accelerator": a.get("hardware", {}).get("accelerator"),
                            "first_seen": None, "last_seen": None, "left_at": None})
    counts: dict[str, dict[str, int]] = {}
    for n in out:
        by_stage = counts.setdefault(n["status"], {})
        key = n["stage"] or n["kind"] or "?"
        by_stage[key] = by_stage.get(key, 0) + 1
    live = sum(1 for n in out if n["status"] in ("syncing", "active"))
    return {"run": run, "as_of": _last_at(s, run), "live": live, "counts": counts, "nodes": out}


def _last_at(s: Session, run: str) -> Optional[float]:
    return s.scalar(select(func.max(Snapshot.at)).where(Snapshot.run == run))


def pooled_tflops(present_workers: list[dict], tflops: dict[str, float]) -> Optional[float]:
    """Pooled TFLOP/s of the present workers, or None when one's accelerator is unknown (or none is present)."""
    total = 0.0
    for n in present_workers:
        spec = tflops.get(n.get("accelerator") or "")
        if spec is None:
            return None
        total += spec
    return total or None


def throughput(s: Session, run: str, tflops: dict[str, float]) -> dict:
    snaps = _snapshots(s, run)
    present = [n for n in nodes(s, run, "")["nodes"] if n["kind"] == "worker" and n["status"] != "left"]
    pooled = pooled_tflops(present, tflops)
    points = []
    for a, b in zip(snaps, snaps[1:]):
        dt = b.at - a.at
        if dt > 0:
            tps = max(0, b.data.get("tokens", 0) - a.data.get("tokens", 0)) / dt
            points.append({"at": b.at, "tokens_per_s": tps, "efficiency": tps / pooled if pooled else None})
    recent = None
    if snaps:  # over the last RATE_WINDOW_S, as `agoractl status` measures it (trainer reports are less frequent
        first = next(x for x in snaps if x.at >= snaps[-1].at - RATE_WINDOW_S)  # than the monitor's reads)
        span = snaps[-1].at - first.at
        recent = max(0, snaps[-1].data.get("tokens", 0) - first.data.get("tokens", 0)) / span if span > 0 else None
    return {"run": run, "as_of": snaps[-1].at if snaps else None, "pooled_tflops": pooled, "points": points,
            "recent": {"window_s": RATE_WINDOW_S, "tokens_per_s": recent,
                       "efficiency": recent / pooled if recent is not None and pooled else None}}


def leaderboard(s: Session, run: str, weights: scores.Weights) -> dict:
    known = authorizer_nodes(s)
    flops = {c.node: c.flops for c in s.scalars(select(Contribution).where(Contribution.run == run))}
    events: dict[str, list] = {}
    for e in s.scalars(select(PresenceEvent).where(PresenceEvent.run == run)):
        events.setdefault(e.node, []).append((e.event, e.at))
    rows = [{"node": p.node, "account": known.get(p.node, {}).get("account") or "unknown", "kind": p.kind,
             "stage": p.stage, "flops": flops.get(p.node, 0.0), "events": events.get(p.node, []),
             "last_seen": p.last_seen}
            for p in s.scalars(select(Presence).where(Presence.run == run))]
    return {"run": run, "as_of": _last_at(s, run), **scores.leaderboard(rows, weights)}


def stages(s: Session, run: str) -> dict:
    last = s.scalars(select(Snapshot).where(Snapshot.run == run).order_by(Snapshot.id.desc()).limit(1)).first()
    return {"run": run, "as_of": last.at if last else None, "stages": (last.data.get("stages", {}) if last else {})}


def latest_eval(s: Session, run: str) -> Optional[dict]:
    e = s.scalars(select(Eval).where(Eval.run == run).order_by(Eval.step.desc(), Eval.id.desc()).limit(1)).first()
    return None if e is None else {"step": e.step, "loss": e.loss, "perplexity": e.perplexity, "tokens": e.tokens,
                                   "at": e.at}
