"""One live swarm with monitoring.enabled (`launch swarm`: DHT seed, one worker per stage, one trainer, the
Health Monitor, a push gateway and a real Prometheus), serving the monitoring issue's live checks at once:

- the Health Monitor is SIGKILLed mid-run and started again by the swarm; at the end its database's sample and
  loss totals equal the trainer's own final statistics exactly;
- the body stage's only worker is SIGKILLed: the database shows it left within its record's TTL plus one
  interval (history kept after its record expired), a stage_below_minimum alert is raised, and Prometheus's
  AgoraStageLostPeers fires in /api/v1/alerts within the rule's `for` plus two scrape intervals; the swarm
  then starts it again (its restart delayed past the alert by local.restart_backoff_s) and Prometheus shows
  the new process's samples in the same series: the same `instance`, the counter reset by the restart;
- a forged trainer report stored in the run's DHT raises forged_report, and the forger is in no aggregate;
- Prometheus shows every worker and the trainer with the labels run, role, stage and instance (the instance the
  node's slot key gives);
- the Dashboard (dashboard.enabled: the swarm starts `agoractl launch dashboard` beside the Health Monitor, on
  its database and this Prometheus, and prints its URL),
  with a second run's rows written into the same database, driven by Playwright in Debian's headless Chromium:
  the page shows as many loss points as the database holds (up to the snapshot its answer was read at), the
  live node count, a node found by its id as active, the leaderboard in score order, both runs side by side; its screenshots (1400 px, and 390 px
  wide with no horizontal scroll) are not blank; its API has each node's live telemetry from Prometheus.

Marked ``swarm`` (one multi-process hivemind run, ~90 s). Needs Debian's prometheus, prometheus-pushgateway and
chromium (`make system-packages`).
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
import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import sync_playwright
from sqlalchemy.orm import Session

from agoractl.auth import node_key
from agoractl.manifest.schema import Run
from agoractl.runtime import node
from agoractl.runtime.records import RunRecords, TrainerRecord
from agoractl.services.authorizer.db import engine_for
from agoractl.services.health.models import Contribution, Presence, PresenceEvent, Snapshot
from agoractl.services.health.stack import binary, free_port
from tests.runtime.test_swarm import (MANIFEST, TINY, agoractl, corpus, err_tail, procs, run_swarm,  # noqa: F401
                                      sets, wait_status)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]
INTERVAL_S, ANNOUNCE_S, SCRAPE_S, FOR_S = 1.0, 1.0, 1.0, 30.0
RESTART_S = FOR_S + 2 * SCRAPE_S + 15
"""The killed body worker is started again this long after its death: once AgoraStageLostPeers fired."""
CHROMIUM = "/usr/bin/chromium"
SECOND_RUN = "monrun-b"


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


def _second_run(db) -> None:
    """A finished second run's rows, written into the live run's database beside its rows."""
    engine = engine_for(f"sqlite:///{db}")
    t = time.time() - 3600
    try:
        with Session(engine) as s:
            for i in range(5):
                s.add(Snapshot(run=SECOND_RUN, at=t + 10 * i, data={
                    "stages": {"head": {"workers": 1, "serving": 1, "phases": {"active": 1}, "step": i}},
                    "completed": 4 * i, "loss_sum": (6.0 - 0.5 * i) * 4 * i, "loss_samples": 4 * i,
                    "tokens": 256 * i}))
            s.add(Presence(run=SECOND_RUN, node="QmSecondRunWorker", kind="worker", stage="head", role="operator",
                           phase="active", first_seen=t, last_seen=t + 40, left_at=t + 45))
            s.add_all([PresenceEvent(run=SECOND_RUN, node="QmSecondRunWorker", kind="worker", stage="head",
                                     event=e, at=at) for e, at in (("joined", t), ("left", t + 45))])
            s.add(Contribution(run=SECOND_RUN, node="QmSecondRunWorker", stage="head", role="operator", samples=16,
                               flops=16e12, updated_at=t + 40))
            s.commit()
    finally:
        engine.dispose()


def _dashboard_up(run_dir, port) -> str:
    """The Dashboard the swarm started (dashboard.enabled): the URL it printed, once it answers."""
    url = re.search(r"dashboard: (http://127\.0\.0\.1:\d+)/ ", err_tail(run_dir)).group(1)
    assert url == f"http://127.0.0.1:{port}", url

    def up():
        try:
            return httpx.get(url + "/api/runs", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
    _wait(up, 90, "the dashboard")
    return url


def _loss_points(db, run, as_of) -> int:
    """Loss points as the database holds them up to AS_OF: snapshots in which the counted loss samples grew."""
    n, prev = 0, 0
    for (data,) in _rows(db, "SELECT data FROM health_snapshots WHERE run = ? AND at <= ? ORDER BY at, id", run,
                         as_of):
        samples = json.loads(data).get("loss_samples", 0)
        n, prev = n + (samples > prev), samples
    return n


def _not_blank(path) -> None:
    img = Image.open(path).convert("RGB")
    pixels = np.asarray(img.resize((img.width // 4, img.height // 4))).reshape(-1, 3)
    inked = float((pixels.min(axis=1) < 200).mean())
    colors = len(np.unique(pixels, axis=0))
    print(f"MEASURED screenshot {path.name}: {img.width}x{img.height}, {colors} colors, {inked:.1%} inked")
    assert colors > 50 and inked > 0.03, (path, colors, inked)


def _browser_checks(url, db, shots, live_nodes: int) -> None:
    """The page in headless Chromium: loss points, live node count, leaderboard order, two runs side by side,
    screenshots at desktop and phone width."""
    sel = 'section.run[data-run="monrun"]'
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url + "/")
            page.wait_for_selector(f'section.run[data-run="{SECOND_RUN}"]', timeout=60_000)
            page.wait_for_function("Number(document.body.dataset.refreshed) >= 1", timeout=60_000)

            as_of, shown = page.evaluate(f"""() => {{ const s = document.querySelector('{sel}');
                return [Number(s.dataset.asOf), s.querySelector('.loss-step').data[0].x.length]; }}""")
            held = _loss_points(db, "monrun", as_of)
            print(f"MEASURED dashboard loss points: page {shown}, database {held} (as of {as_of})")
            assert shown == held > 0

            counts = []

            def live():  # every worker and trainer is present: the page's count is the database's
                page_n = int(page.text_content(f"{sel} .live-nodes"))
                db_n = _rows(db, "SELECT count(*) FROM health_presence WHERE run = 'monrun' AND left_at IS NULL")
                counts.append((page_n, db_n and db_n[0][0]))
                return page_n if db_n and page_n == db_n[0][0] == live_nodes else None
            try:
                _wait(live, 30, f"the page's live node count to equal the database's, {live_nodes}")
            finally:
                print(f"MEASURED dashboard live nodes (page, database): {counts[-3:]}, expected {live_nodes}")

            peer = _rows(db, "SELECT node FROM health_presence WHERE run = 'monrun' AND stage = 'head'")[0][0]
            page.fill("#find", peer[-12:])  # a contributor finds their node by (part of) its id
            assert f"monrun: {peer} is active" in page.text_content("#found")
            page.fill("#find", "")

            scores = [float(x) for x in page.locator(f"{sel} table.leaderboard td.score").all_text_contents()]
            seen = _rows(db, "SELECT count(*) FROM health_presence WHERE run = 'monrun'")[0][0]
            assert len(scores) == seen and scores == sorted(scores, reverse=True) and scores[0] > 0, scores

            boxes = page.evaluate("[...document.querySelectorAll('section.run')].map(s => { const r = "
                                  "s.getBoundingClientRect(); return [s.dataset.run, r.left, r.top, r.right]; })")
            assert [b[0] for b in boxes] == ["monrun", SECOND_RUN], boxes
            assert boxes[0][2] == boxes[1][2] and boxes[0][3] <= boxes[1][1], boxes  # one row, two columns
            page.screenshot(path=shots / "dashboard.png", full_page=True)
            _not_blank(shots / "dashboard.png")

            page.set_viewport_size({"width": 390, "height": 844})
            refreshed = int(page.evaluate("document.body.dataset.refreshed"))
            page.wait_for_function(f"Number(document.body.dataset.refreshed) > {refreshed}", timeout=60_000)
            width = page.evaluate("[document.documentElement.scrollWidth, document.body.scrollWidth, innerWidth]")
            assert max(width[:2]) <= width[2] == 390, width
            page.screenshot(path=shots / "dashboard-390.png", full_page=True)
            _not_blank(shots / "dashboard-390.png")
        finally:
            browser.close()


def test_monitoring_swarm(corpus, procs, tmp_path):
    for b in ("prometheus", "prometheus-pushgateway"):
        binary(b)  # fails (never skips) without the Debian packages
    assert os.access(CHROMIUM, os.X_OK), f"{CHROMIUM} missing: `make system-packages` installs Debian's chromium"
    run_dir, dashboard_port = tmp_path / "run", free_port()
    values = [*corpus, *TINY, "metadata.name=monrun", "training.max_steps=100000", "local.max_restarts=1",
              f"local.restart_backoff_s={RESTART_S:g}",
              f"workers.announce_period_s={ANNOUNCE_S:g}", "monitoring.enabled=true",
              f"monitoring.interval_s={INTERVAL_S:g}", f"monitoring.scrape_interval_s={SCRAPE_S:g}",
              "monitoring.min_replicas=1", "dashboard.enabled=true", f"dashboard.port={dashboard_port}",
              "dashboard.cache_s=1", "dashboard.refresh_s=2"]
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

    # The Dashboard on this database (a second run's rows beside the live run's) and this Prometheus.
    t_dashboard = time.monotonic()
    _second_run(db)
    dashboard = _dashboard_up(run_dir, dashboard_port)
    assert _node(st, "dashboard")["exit_code"] is None  # a utility node of the swarm
    _browser_checks(dashboard, db, tmp_path, sum(n["name"].startswith(("worker-", "trainer-")) for n in st["nodes"]))
    telemetry = httpx.get(f"{dashboard}/api/runs/monrun/telemetry", timeout=30).json()
    assert {(n["role"], n["stage"]) for n in telemetry["nodes"]} == expected, telemetry
    assert "error" not in httpx.get(f"{dashboard}/api/runs/monrun/stages", timeout=30).json()["sparta"]
    print(f"MEASURED dashboard_checks_s={time.monotonic() - t_dashboard:.1f}")

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

    # The swarm starts the body worker again (its slot key: the same instance); Prometheus's series for that
    # instance goes on with the new process's counts (a counter reset) and no other body series appears.
    wait_status(status_path, p, lambda s: any(n["name"] == "worker-body-1-0.r1" and n["exit_code"] is None
                                              for n in s["nodes"]), timeout=RESTART_S + 30)

    def continued():
        q = 'resets(agora_samples_total{role="worker",stage="body-1"}[10m]) > 0'
        r = httpx.get(f"{prom}/api/v1/query", params={"query": q}, timeout=10).json()["data"]["result"]
        return r or None
    assert [m["metric"]["instance"] for m in _wait(continued, 90, "the restarted worker's samples")] == [body_instance]
    r = httpx.get(f"{prom}/api/v1/series", params={"match[]": 'agora_samples_total{stage="body-1"}'}, timeout=10)
    assert {m["instance"] for m in r.json()["data"]} == {body_instance}

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
