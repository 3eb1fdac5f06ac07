"""The Health Monitor against a real hivemind DHT (one seed process on loopback) and a real database (SQLite in
tmp_path, and PostgreSQL on 127.0.0.1:5432 in a database of its own, both written from the same readings):
presence history, progress counted once across a monitor restart, forged reports flagged and excluded, and every
check's alert; then `agoractl status`. The same checks live, from a real swarm's records with an Authorizer:
tests/runtime/test_admission_swarm.py.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/services/health/test_monitor.py -q
"""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from agoractl.auth import node_key
from agoractl.manifest.plan import stage_flops_per_sample
from agoractl.manifest.schema import Run
from agoractl.runtime import node
from agoractl.runtime.records import RunRecords, TrainerRecord, WorkerRecord
from agoractl.services.health.db import migrate
from agoractl.services.authorizer.db import engine_for
from agoractl.services.health.models import Alert, Contribution, Flagged, Presence, PresenceEvent, TrainerSession
from agoractl.services.health.monitor import Monitor, read
from tests.conftest import MANIFESTS
from tests.services.conftest import pg_database

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def dht():
    d = node.start_dht(Run())
    yield d
    node.shutdown_dht(d)


@pytest.fixture
def engines(tmp_path):
    """Both back ends at once, each written by its own Monitor from the same readings: SQLite in tmp_path, and
    PostgreSQL in a database of its own (dropped after, also on failure)."""
    out = {"sqlite": engine_for(f"sqlite:///{tmp_path / 'health.db'}")}
    try:
        migrate(out["sqlite"])
        with pg_database("agora_health") as url:
            out["postgres"] = engine_for(url)
            try:
                migrate(out["postgres"])
                migrate(out["postgres"])  # idempotent
                yield out
            finally:
                out.pop("postgres").dispose()
    finally:
        for eng in out.values():
            eng.dispose()


def _run(name: str, **monitoring) -> Run:
    return Run.model_validate({"metadata": {"name": name}, "monitoring": {"min_replicas": 1, **monitoring}})


def test_presence_progress_forgery_and_checks(dht, engines):
    run = _run(f"h{uuid.uuid4().hex[:8]}", stall_after_s=3.0)
    records, stages = RunRecords(dht, run.metadata.name), run.stage_names()
    key, forger_key = node_key.load_or_create(), node_key.load_or_create()

    def tick(monitors, **kw) -> dict:
        """One reading, written by every monitor: {back end: the set of (kind, subject) that hold}."""
        reading = read(records, stages, **kw)
        return {b: {(c.kind, c.subject) for c in m.tick(reading)} for b, m in monitors.items()}

    # Two workers of the head (one expires soon), one of the tail; body-1 has none.
    for peer, stage, ttl, samples in (("peerA", "head", 60, 10), ("peerB", "head", 2, 4), ("peerC", "tail", 60, 7)):
        records.announce_worker(WorkerRecord(peer=peer, stage=stage, samples=samples), ttl)
    rec = TrainerRecord(trainer=0, peer="tpeer", completed=5, session="s1", seq=3, loss_sum=11.25, loss_samples=5)
    records.publish_trainer(rec, 60, key)

    monitors = {b: Monitor(run, e) for b, e in engines.items()}
    for found in tick(monitors).values():
        assert found == {("stage_below_minimum", "body-1")}
    time.sleep(2.5)  # peerB's record expires
    tick(monitors)
    for engine in engines.values():
        with Session(engine) as s:
            left = s.get(Presence, "peerB")
            assert left.left_at is not None and left.first_seen < left.left_at
            assert [e.event for e in s.scalars(select(PresenceEvent).where(PresenceEvent.node == "peerB")
                                               .order_by(PresenceEvent.id))] == ["joined", "left"]
            assert s.get(Presence, "peerA").left_at is None
            assert s.get(Contribution, "peerA").flops == 10 * stage_flops_per_sample(run, 0)

    # A monitor restart (a new Monitor on the same database) reading the same report counts nothing twice;
    # a newer report replaces the cumulative counts.
    monitors = {b: Monitor(run, e) for b, e in engines.items()}
    tick(monitors)
    for engine in engines.values():
        with Session(engine) as s:
            row = s.get(TrainerSession, (0, "s1"))
            assert (row.seq, row.completed, row.loss_sum, row.loss_samples) == (3, 5, 11.25, 5)
    records.publish_trainer(TrainerRecord(trainer=0, peer="tpeer", completed=9, session="s1", seq=4,
                                          loss_sum=20.5, loss_samples=9), 60, key)
    tick(monitors)
    for engine in engines.values():
        with Session(engine) as s:
            row = s.get(TrainerSession, (0, "s1"))
            assert (row.seq, row.completed, row.loss_sum) == (4, 9, 20.5)

    # Forgeries: a tampered report under trainer 1, and trainer 0's index signed by another key.
    tampered = TrainerRecord(trainer=1, peer="evil", completed=1000, session="x", seq=1).signed(forger_key)
    tampered["completed"] = 10**6
    records._store(f"{run.metadata.name}.trainers", tampered, 60, "1")
    for found in tick(monitors).values():
        assert ("forged_report", forger_key and tampered["key"]) in found
    records.publish_trainer(TrainerRecord(trainer=0, peer="evil", completed=500, session="y", seq=1), 60, forger_key)
    tick(monitors)
    for engine in engines.values():
        with Session(engine) as s:
            assert s.get(Flagged, tampered["key"]) is not None
            assert {r.session for r in s.scalars(select(TrainerSession))} == {"s1"}  # the forger counted nowhere
            kinds = {a.kind for a in s.scalars(select(Alert).where(Alert.resolved_at.is_(None)))}
        assert {"forged_report", "stage_below_minimum"} <= kinds

    # Announcers against the Authorizer's list; progress stalled after stall_after_s without new samples.
    time.sleep(3.2)
    admitted = {"peerA": "head", "peerC": "head"}
    for found in tick(monitors, admitted=lambda: admitted).values():
        assert ("wrong_stage_announcer", "peerC") in found and ("unadmitted_announcer", "peerA") not in found
        assert ("progress_stalled", "run") in found
    records.announce_worker(WorkerRecord(peer="peerD", stage="body-1"), 60)
    for found in tick(monitors, admitted=lambda: admitted).values():
        assert ("unadmitted_announcer", "peerD") in found and ("stage_below_minimum", "body-1") not in found
    for engine in engines.values():
        with Session(engine) as s:
            resolved = s.scalars(select(Alert).where(Alert.kind == "stage_below_minimum")).one()
            assert resolved.resolved_at is not None


def test_status_command(dht, cli, tmp_path):
    run_dir = tmp_path / "rd"
    name = f"h{uuid.uuid4().hex[:8]}"
    run = Run.model_validate({"metadata": {"name": name}, "local": {"run_dir": str(run_dir)}})
    from agoractl.services.health.db import open_database

    engine = open_database(run)
    records = RunRecords(dht, name)
    records.announce_worker(WorkerRecord(peer="p1", stage="head", step=3), 60)
    records.publish_trainer(TrainerRecord(trainer=0, peer="t", completed=4, session="s", seq=1, loss_sum=8.0,
                                          loss_samples=4), 60, node_key.load_or_create())
    Monitor(run, engine).tick(read(records, run.stage_names()))
    engine.dispose()
    args = ["status", str(MANIFESTS / "local-cpu.yaml"), "--set", f"metadata.name={name}", "--set", f"local.run_dir={run_dir}"]
    # Three independent processes at once: on a loaded machine each gets its own share of the CPU.
    with ThreadPoolExecutor(3) as pool:
        out, human, empty = pool.map(lambda a: cli(*a), [
            (*args, "--json"), args, ("status", str(MANIFESTS / "local-cpu.yaml"), "--set",
                                      f"local.run_dir={tmp_path / 'none'}")])
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert (s["samples"], s["loss"], s["step"]) == (4, 2.0, 3)
    assert {a["kind"] for a in s["alerts"]} == {"stage_below_minimum"}
    assert human.returncode == 0, human.stderr
    assert "stage_below_minimum" in human.stdout and "samples 4" in human.stdout
    assert empty.returncode == 2 and "error:" in empty.stderr and "hint:" in empty.stderr
