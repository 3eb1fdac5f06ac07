"""Several runs in one Health Monitor database (schema h0002): two monitors of two runs tick on one SQLite
database without touching each other's nodes, alerts, trainer keys or totals, and rows written by a monitor
before the schema named runs (h0001) are adopted by the run's monitor after the upgrade. Real SQLite in
tmp_path, the monitor's own Alembic migrations; readings built in memory (no DHT).

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/services/health/test_runs.py -q
"""

from __future__ import annotations

import time

from alembic import command
from alembic.config import Config
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from agoractl.auth import node_key
from agoractl.manifest.schema import Run
from agoractl.runtime.records import TrainerRecord, WorkerRecord
from agoractl.services.authorizer.db import engine_for
from agoractl.services.health.checks import Reading
from agoractl.services.health.db import MIGRATIONS, migrate
from agoractl.services.health.models import Alert, Presence, Snapshot, TrainerKey
from agoractl.services.health.monitor import Monitor
from agoractl.services.health.status import summary


def _run(name: str) -> Run:
    return Run.model_validate({"metadata": {"name": name}, "monitoring": {"min_replicas": 1}})


def _reading(workers: dict, trainers: dict | None = None) -> Reading:
    return Reading(at=time.time(), workers=workers, trainers=trainers or {})


def test_two_runs_share_a_database(tmp_path):
    engine = engine_for(f"sqlite:///{tmp_path / 'health.db'}")
    migrate(engine)
    a, b = Monitor(_run("runa"), engine), Monitor(_run("runb"), engine)
    key_a, key_b = node_key.load_or_create(), node_key.load_or_create()
    rec_a = TrainerRecord(trainer=0, peer="ta", completed=6, session="sa", seq=1, loss_sum=12.0, loss_samples=6)
    rec_b = TrainerRecord(trainer=0, peer="tb", completed=2, session="sb", seq=1, loss_sum=8.0, loss_samples=2)
    heads = {st: {f"p-{st}": WorkerRecord(peer=f"p-{st}", stage=st, samples=3)} for st in ("head", "body-1", "tail")}
    a.tick(_reading(heads, {0: (TrainerRecord.from_dict(rec_a.signed(key_a)), True)}))
    # Run b: trainer 0 under another key (its own run's first key, not a forgery), and no workers at all.
    conditions = b.tick(_reading({}, {0: (TrainerRecord.from_dict(rec_b.signed(key_b)), True)}))
    assert {c.kind for c in conditions} == {"stage_below_minimum"}
    a.tick(_reading(heads, {0: (TrainerRecord.from_dict(rec_a.signed(key_a)), True)}))
    with Session(engine) as s:
        assert {(p.run, p.node, p.left_at) for p in s.scalars(select(Presence)) if p.kind == "worker"} == {
            ("runa", "p-head", None), ("runa", "p-body-1", None), ("runa", "p-tail", None)}  # b marked none left
        assert {(k.run, k.trainer) for k in s.scalars(select(TrainerKey))} == {("runa", 0), ("runb", 0)}
        assert {(x.run, x.kind) for x in s.scalars(select(Alert))} == {("runb", "stage_below_minimum")}
    sa, sb = summary(engine, "runa"), summary(engine, "runb")
    assert (sa["samples"], sa["loss"], sa["nodes"]["workers"]) == (6, 2.0, 3)
    assert (sb["samples"], sb["loss"], sb["nodes"]["workers"]) == (2, 4.0, 0)
    engine.dispose()


def test_rows_before_runs_are_adopted(tmp_path):
    engine = engine_for(f"sqlite:///{tmp_path / 'health.db'}")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "h0001")
        conn.execute(text("INSERT INTO health_snapshots (at, data) VALUES (1.0, '{}')"))
        conn.execute(text("INSERT INTO health_trainer_keys (trainer, key, at) VALUES (0, 'k', 1.0)"))
    migrate(engine)
    Monitor(_run("old"), engine)
    with Session(engine) as s:
        assert [x.run for x in s.scalars(select(Snapshot))] == ["old"]
        assert [(k.run, k.trainer, k.key) for k in s.scalars(select(TrainerKey))] == [("old", 0, "k")]
    engine.dispose()
