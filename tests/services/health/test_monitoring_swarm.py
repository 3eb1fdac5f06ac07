"""One live swarm with monitoring.enabled (`launch swarm`: DHT seed, one worker per stage, one trainer, the
Health Monitor, a push gateway and a real Prometheus), serving the monitoring issue's live checks at once:

- the Health Monitor is SIGKILLed mid-run and started again by the swarm; at the end its database's sample and
  loss totals equal the trainer's own final statistics exactly;
- the body stage's only worker is SIGKILLed: the database shows it left within its record's TTL plus one
  interval (history kept after its record expired), a stage_below_minimum alert is raised, and Prometheus's
  AgoraStageLostPeers fires in /api/v1/alerts within the rule's `for` plus two scrape intervals;
- a forged trainer report stored in the run's DHT raises forged_report, and the forger is in no aggregate;
- Prometheus shows every worker and the trainer with the labels run, role, stage and instance (the instance the
  node's slot key gives).

Marked ``swarm`` (one multi-process hivemind run, ~90 s). Needs Debian's prometheus and prometheus-pushgateway.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import time

import httpx
import pytest

from agoractl.auth import node_key
from agoractl.manifest.schema import Run
from agoractl.runtime import node
from agoractl.runtime.records import RunRecords, TrainerRecord
from agoractl.services.health.stack import binary
from tests.runtime.test_swarm import TINY, corpus, err_tail, procs, run_swarm, wait_status  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]
INTERVAL_S, ANNOUNCE_S, SCRAPE_S, FOR_S = 1.0, 1.0, 1.0, 30.0


def _rows(db, sql, *args):
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as c:
            return c.execute(sql, args).fetchall()
    except sqlite3.Error:
        return []


def _wait(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def _node(status, name):
    return next(n for n in status["nodes"] if n["name"] == name)


def test_monitoring_swarm(corpus, procs, tmp_path):
    for b in ("prometheus", "prometheus-pushgateway"):
        binary(b)  # fails (never skips) without the Debian packages
    run_dir = tmp_path / "run"
    values = [*corpus, *TINY, "metadata.name=monrun", "training.max_steps=100000", "local.max_restarts=0",
              f"workers.announce_period_s={ANNOUNCE_S:g}", "monitoring.enabled=true",
              f"monitoring.interval_s={INTERVAL_S:g}", f"monitoring.scrape_interval_s={SCRAPE_S:g}",
              "monitoring.min_replicas=1"]
    p, status_path = run_swarm(procs, run_dir, values)
    db = run_dir / "health" / "health.db"
    st = wait_status(status_path, p, lambda s: s["completed_samples"] >= 4, timeout=240)
    prom = re.search(r"Prometheus (http://127\.0\.0\.1:\d+)", err_tail(run_dir)).group(1)
    _wait(lambda: _rows(db, "SELECT completed FROM health_trainer_sessions WHERE completed > 0"), 30, "progress in the db")

    # The Health Monitor dies (SIGKILL) and the swarm starts it again; a forged report goes into the DHT.
    os.killpg(_node(st, "health")["pid"], signal.SIGKILL)
    dht = node.start_dht(Run(), st["maddrs"], client_mode=True)
    try:
        forged = TrainerRecord(trainer=5, peer="forger", completed=10**6, session="f", seq=1, loss_sum=1.0,
                               loss_samples=10**6).signed(node_key.load_or_create())
        forged["completed"] += 1  # tampered after signing
        RunRecords(dht, "monrun")._store("monrun.trainers", forged, 60, "5")
    finally:
        node.shutdown_dht(dht)
    wait_status(status_path, p, lambda s: any(n["name"] == "health.r1" for n in s["nodes"]), timeout=30)
    t_restart = time.time()  # the restarted monitor writes again (its DHT up) before the worker is killed
    _wait(lambda: _rows(db, "SELECT id FROM health_snapshots WHERE at > ?", t_restart), 180, "the restarted monitor")

    # Prometheus sees every node with the four labels, instance = its slot key's.
    expected = {("worker", "head"), ("worker", "body-1"), ("worker", "tail"), ("trainer", "")}

    def series():  # a scrape of a busy node can time out on a loaded machine: wait until each was seen
        r = httpx.get(f"{prom}/api/v1/query", params={"query": "agora_ram_bytes"}, timeout=10).json()
        got = [x["metric"] for x in r["data"]["result"]]
        return got if {(m["role"], m.get("stage", "")) for m in got} == expected else None
    labels = _wait(series, 90, "every node in Prometheus")
    odd = [m for m in labels if m["run"] != "monrun" or not re.fullmatch(r"[0-9a-f]{16}", m["instance"])]
    assert not odd, json.dumps(odd)
    body_key = run_dir / "swarm" / "keys" / "worker-body-1-0.key"
    body_instance = node_key.instance_id(node_key.load_or_create(body_key))
    assert body_instance in {m["instance"] for m in labels if m.get("stage") == "body-1"}

    # The body stage's only worker is SIGKILLed.
    body_peer = _rows(db, "SELECT node FROM health_presence WHERE stage = 'body-1' AND left_at IS NULL")[0][0]
    t_kill = time.time()
    os.killpg(_node(st, "worker-body-1-0")["pid"], signal.SIGKILL)
    left_at = _wait(lambda: _rows(db, "SELECT left_at FROM health_presence WHERE node = ? AND left_at IS NOT NULL",
                                  body_peer), 30, "the killed worker marked left")[0][0]
    ttl = 3 * ANNOUNCE_S
    left_after = left_at - t_kill
    print(f"MEASURED left_after_kill_s={left_after:.2f} (ttl {ttl:g} + interval {INTERVAL_S:g})")
    _wait(lambda: _rows(db, "SELECT id FROM health_alerts WHERE kind='stage_below_minimum' AND subject='body-1'"),
          10, "stage_below_minimum")

    def firing():
        alerts = httpx.get(f"{prom}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "AgoraStageLostPeers"
                and a["labels"].get("stage") == "body-1" and a["state"] == "firing"]
    _wait(firing, FOR_S + 30, "AgoraStageLostPeers firing")
    fired_after = time.time() - t_kill
    print(f"MEASURED alert_firing_after_kill_s={fired_after:.2f} (for {FOR_S:g} + 2 scrapes {2 * SCRAPE_S:g})")

    # The history outlives the record; the forger was flagged and is in no aggregate.
    events = [e for (e,) in _rows(db, "SELECT event FROM health_presence_events WHERE node = ? ORDER BY id", body_peer)]
    assert events == ["joined", "left"]
    assert _rows(db, "SELECT subject FROM health_flagged")
    assert _rows(db, "SELECT id FROM health_alerts WHERE kind = 'forged_report'")
    assert not _rows(db, "SELECT session FROM health_trainer_sessions WHERE session = 'f'")

    # Stop the run (SIGTERM): the trainer writes its final stats, the monitor reads its final report.
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the swarm did not stop; stderr:\n{err_tail(run_dir)}")
    stats = json.loads((run_dir / "swarm" / "nodes" / "trainer-0.json").read_text())
    row = _rows(db, "SELECT completed, loss_sum, loss_samples FROM health_trainer_sessions WHERE trainer = 0 AND "
                    "session = ?", stats["session"])
    assert row == [(stats["completed"], stats["loss_sum"], stats["loss_samples"])], err_tail(run_dir)
    assert left_after <= ttl + INTERVAL_S + 1.0, left_after  # +1 s: a loaded machine's read of the DHT
    assert fired_after <= FOR_S + 2 * SCRAPE_S + 5.0, fired_after  # +5 s: Prometheus's evaluation alignment
