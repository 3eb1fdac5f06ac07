"""A Health Monitor database holding two runs, written row by row with the monitor's own models (no swarm), for the
Dashboard's tests: run ``alpha`` (three workers, one of which left and one of which is syncing, a trainer, five
snapshots, two evaluations, and the Authorizer's ``nodes`` table with accounts and hardware, one node admitted
and not yet seen) and run ``beta`` (a worker and a trainer, two snapshots). On SQLite in tmp_path and on the
real PostgreSQL (127.0.0.1:5432) in a database of its own, dropped after. Every expected number in the tests is
worked out by hand from the rows below.
"""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session

from agoractl.manifest.schema import Run
from agoractl.services.authorizer import db as authorizer_db
from agoractl.services.authorizer.models import Node
from agoractl.services.health.db import migrate
from agoractl.services.health.models import Contribution, Eval, Presence, PresenceEvent, Snapshot
from tests.services.conftest import pg_database

T0 = 1000.0
H = 3600.0
FLOPS_PER_SAMPLE = {"head": 2e12, "body-1": 3e12, "tail": 2.5e12}
"""The fixture's FLOPs per sample by stage (a worker's contribution: samples x these)."""
TFLOPS = {"gpu-a": 100.0, "gpu-b": 156.0}


def dashboard_run(**dashboard) -> Run:
    """The dashboard's manifest: run alpha, scores 10 points per PFLOP and 2 per hour."""
    return Run.model_validate({"metadata": {"name": "alpha"}, "dashboard": {
        "score": {"points_per_pflop": 10.0, "points_per_hour": 2.0}, "accelerator_tflops": TFLOPS, **dashboard}})


def _snap(run, at, loss_sum, loss_samples, tokens, step):
    stages = {st: {"workers": 1, "serving": 1, "phases": {"active": 1}, "step": step} for st in FLOPS_PER_SAMPLE}
    return Snapshot(run=run, at=at, data={"stages": stages, "nodes": 3, "sessions": 1, "completed": loss_samples,
                                          "loss_sum": loss_sum, "loss_samples": loss_samples, "tokens": tokens})


def _node(run, peer, kind, stage, phase, first, last, left, events, samples=0):
    rows = [Presence(run=run, node=peer, kind=kind, stage=stage, role="operator" if kind == "worker" else "",
                     phase=phase, first_seen=first, last_seen=last, left_at=left)]
    rows += [PresenceEvent(run=run, node=peer, kind=kind, stage=stage, event=e, at=at) for e, at in events]
    if kind == "worker":
        rows.append(Contribution(run=run, node=peer, stage=stage, role="operator", samples=samples,
                                 flops=samples * FLOPS_PER_SAMPLE[stage], updated_at=last))
    return rows


def _authorizer(peer, account, stage, status, accelerator):
    return Node(node_id=f"n-{peer}", account=account, operator=False, role="worker", peer_id=peer, stage=stage,
                status=status, hardware={"ram_gb": 128, "vram_gb": 24, "accelerator": accelerator}, multiaddrs=[],
                requested_at=T0, admitted_at=T0, expires_at=T0 + 300, serial=1, step=0)


def fill(engine) -> None:
    authorizer_db.migrate(engine)
    migrate(engine)
    with Session(engine) as s:
        s.add_all([_snap("alpha", T0 + 10, 0.0, 0, 0, 0), _snap("alpha", T0 + 20, 20.0, 4, 256, 1),
                   _snap("alpha", T0 + 30, 20.0, 4, 256, 1), _snap("alpha", T0 + 40, 38.0, 8, 512, 2),
                   _snap("alpha", T0 + 50, 52.0, 12, 768, 3),
                   _snap("beta", 2000.0, 10.0, 2, 128, 1), _snap("beta", 2010.0, 19.0, 4, 256, 2)])
        s.add_all(_node("alpha", "QmHead", "worker", "head", "active", T0, T0 + 2 * H, None, [("joined", T0)], 1000))
        s.add_all(_node("alpha", "QmBody", "worker", "body-1", "weight_sync", T0, T0 + 1.5 * H, None,
                        [("joined", T0), ("left", T0 + 0.5 * H), ("joined", T0 + H)], 500))
        s.add_all(_node("alpha", "QmTail", "worker", "tail", "active", T0, T0 + H, T0 + H,
                        [("joined", T0), ("left", T0 + H)], 800))
        s.add_all(_node("alpha", "QmTrainer", "trainer", None, "", T0, T0 + 2 * H, None, [("joined", T0)]))
        s.add_all(_node("beta", "QmBetaHead", "worker", "head", "active", 2000.0, 2000.0 + H, None,
                        [("joined", 2000.0)], 100))
        s.add_all(_node("beta", "QmBetaTrainer", "trainer", None, "", 2000.0, 2000.0 + H, None, [("joined", 2000.0)]))
        s.add_all([_authorizer("QmHead", "alice", "head", "admitted", "gpu-a"),
                   _authorizer("QmBody", "bob", "body-1", "admitted", "gpu-b"),
                   _authorizer("QmTail", "alice", "tail", "left", "gpu-a"),
                   _authorizer("QmNew", "carol", "body-1", "admitted", "gpu-b")])
        s.add_all([Eval(run="alpha", step=10, loss=4.0, perplexity=54.598, tokens=4096, at=T0 + 30),
                   Eval(run="alpha", step=20, loss=3.5, perplexity=33.115, tokens=4096, at=T0 + 45)])
        s.commit()


@pytest.fixture(params=["sqlite", "postgres"])
def fixture_db(request, tmp_path):
    """The two-run database's engine (filled), on each back end."""
    if request.param == "sqlite":
        eng = authorizer_db.engine_for(f"sqlite:///{tmp_path / 'health.db'}")
        fill(eng)
        yield eng
        eng.dispose()
        return
    with pg_database("agora_dash") as url:
        eng = authorizer_db.engine_for(url)
        try:
            fill(eng)
            yield eng
        finally:
            eng.dispose()
