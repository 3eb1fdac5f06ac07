"""One real swarm with admission on (``admission.enabled: true``) and SPARTA averaging (2 stages x 2 workers,
one trainer), every node joining through an Authorizer that the test runs as its own process (`agoractl launch
authorizer`) on the real PostgreSQL and Redis, and the Health Monitor (`agoractl launch health`, started by the
test) joining it with a ``monitor`` credential. While it trains, the test attacks it from its own process:

- over libp2p, stage requests to the head and averaging RPCs (handshake, join, part, state download) to a head
  worker's averager, with no credential, a tampered one, one signed by another authority, another peer's, an
  expired one, a banned node's (and, for averaging, another stage's): each refused, every time, with its own
  reason, and counted by the worker dialled; the honest SPARTA rounds go on meanwhile, and no worker's gate
  refuses an honest peer (each worker's averaging refusals are exactly the rogue's attempts); the replicas' progress
  pushes (``workers.progress_push``) are taken, an unadmitted tail worker's refused;
- an unadmitted worker's DHT records are dropped, so no trainer ever sends it a sample; so are records stored
  (from a DHT node in the test process) with each spoiled credential, and counted where they were dropped;
- real records reach the Health Monitor: a node the Authorizer admitted to one stage announces another
  (``wrong_stage_announcer``), then leaves the run and keeps announcing (``unadmitted_announcer``); the
  trainer is stopped (SIGSTOP) until ``progress_stalled`` is raised, and resumed. Each alert within two
  intervals (+2 s for a loaded machine) of its condition (the stall: ``stall_after_s`` plus that).

Then the Authorizer is killed (SIGKILL) and started again on the same database: the nodes train on meanwhile,
no node, queue entry or ban is lost, and every admitted node renews through the new process (the credentials
live 60 s: a node renews every 30 s or so). The run has no step limit: it is stopped with Ctrl-C once it has
trained 10 steps past the renewals, so how fast the machine trains does not matter."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid

import sqlite3

import httpx
import pytest
import torch

from agoractl.auth import credential, keys
from agoractl.runtime.averaging import averager_prefix
from tests.conftest import private_shards
from tests.services.conftest import PG, REDIS
from tests.runtime.test_averaging_auth import RPCS, refused_every_time
from tests.runtime.test_averaging_auth import attack as averaging_attack
from tests.runtime.test_swarm import (MANIFEST, TINY, agoractl, err_tail, procs,  # noqa: F401  (fixture)
                                      run_swarm, sets, wait_status)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(900)]
ATTEMPTS = 3
SPARTA = ["stages=[{role: head, layers: 2}, {role: tail, layers: 2}]", "local.workers_per_stage=2",
          "data_parallel.method=sparta", "data_parallel.sparta.every_steps=5",
          "data_parallel.sparta.matchmaking_timeout_s=10", "training.max_steps=100000",
          # The magnitude check's false positive (issue 25: bounds from a node's own short history) banned both
          # tail workers for 600 s in one run here; validation is not what this swarm tests.
          "validation.enabled=false"]
INTERVAL_S, STALL_S = 1.0, 6.0
MONITOR = [f"monitoring.interval_s={INTERVAL_S:g}", f"monitoring.stall_after_s={STALL_S:g}"]
ADMISSION = ["admission.enabled=true", "admission.min_vram_gb=0", "admission.min_ram_gb=0",
             "admission.min_bandwidth_mbps=0", "admission.max_latency_ms=10000", "admission.joins_per_minute=6000",
             "admission.credential_ttl_s=60"]
TTL = 60.0
"""Nodes renew at half-life, so every node renews within TTL/2 of the restart; an outage longer than about
3/8 TTL lets the unluckiest nodes' credentials expire (docs/admission.md), hence the Authorizer's restart
must take less (seconds on an idle machine; 13.6 s was measured at load 13-20 with this swarm)."""


@pytest.fixture
def durable(tmp_path):
    """The environment of an Authorizer on its own PostgreSQL database and Redis key prefix (both removed after)."""
    import psycopg
    import redis

    tag = uuid.uuid4().hex[:12]
    db, prefix = f"agora_test_{tag}", f"agoratest:{tag}:"
    with psycopg.connect(f"{PG}/postgres", autocommit=True, connect_timeout=5) as c:
        c.execute(f'CREATE DATABASE "{db}"')
    try:
        yield {"AGORA_DATABASE_URL": f"{PG}/{db}", "AGORA_REDIS_URL": REDIS, "AGORA_REDIS_PREFIX": prefix}
    finally:
        r = redis.Redis.from_url(REDIS)
        stale = list(r.scan_iter(prefix + "*"))
        if stale:
            r.delete(*stale)
        r.close()
        with psycopg.connect(f"{PG}/postgres", autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_authorizer(procs, values, port: int, env: dict, err_path) -> subprocess.Popen:
    """`agoractl launch authorizer` on `port`; returns once it answers."""
    p = procs.start(agoractl("launch", "authorizer", str(MANIFEST), *sets(values), "--port", str(port)),
                    env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=open(err_path, "ab"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert p.poll() is None, err_path.read_text()[-2000:]
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/ping", timeout=5).raise_for_status()
            return p
        except httpx.HTTPError:
            time.sleep(0.2)
    pytest.fail("the Authorizer never answered")


async def attack(maddrs: list[str], run: str, head: str, tokens: dict) -> dict:
    """Send ATTEMPTS head forward requests per credential in TOKENS from a fresh libp2p peer; the errors."""
    from hivemind.p2p import P2P

    from agoractl.runtime.transport import StageClient

    p2p = await P2P.create(initial_peers=maddrs)
    ours = p2p.peer_id.to_base58()
    out: dict[str, list[str]] = {}
    try:
        for name, make in tokens.items():
            client = StageClient(p2p, run, credential=(lambda m=make: m(ours)) if make else None)
            for _ in range(ATTEMPTS):
                try:
                    await client.call(head, "head", "forward", {"ids": torch.zeros(1, 64, dtype=torch.int64)},
                                      timeout=60)
                    out.setdefault(name, []).append("served")
                except Exception as e:
                    out.setdefault(name, []).append(str(e))
    finally:
        await p2p.shutdown()
    return out



def _rows(db, sql, *args) -> list:
    """Rows of the Health Monitor's SQLite database, read-only ([] while it does not exist yet)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as c:
            return c.execute(sql, args).fetchall()
    except sqlite3.Error:
        return []


def _wait(pred, timeout_s: float, what: str, p=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert p is None or p.poll() is None, f"the swarm exited early ({p.returncode}) waiting for {what}"
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def _alert(db, kind: str, subject: str, since: float) -> list:
    return _rows(db, "SELECT raised_at FROM health_alerts WHERE kind = ? AND subject = ? AND raised_at >= ?",
                 kind, subject, since)


def misannouncing_node(values, maddrs, url: str) -> tuple:
    """A DHT node in this process, admitted by the Authorizer as a worker (its real credential, in its record
    validator): it announces another stage than the one it was given. Returns (dht, records, peer, stage given,
    stage announced, credential)."""
    from agoractl import __version__
    from agoractl.manifest.loader import load_manifest
    from agoractl.runtime import admission, node, peer_auth
    from agoractl.runtime.records import RunRecords, WorkerRecord

    dht = node.start_dht(load_manifest(MANIFEST, values), maddrs, client_mode=True)
    peer = dht.peer_id.to_base58()
    out = httpx.post(url + "/v1/join", timeout=30, json={
        "node_id": "misannouncer", "role": "worker", "peer_id": peer, "ready": True,
        "client": {"version": __version__, "package_hash": admission.package_hash()}}).json()
    assert out["status"] == "admitted", out
    peer_auth.push(dht, out["credential"], frozenset())
    given = out["stage"]
    announced = "tail" if given == "head" else "head"
    records = RunRecords(dht, "local-cpu")
    # Not a serving phase: trainers route no sample to it; the monitor reads every worker record.
    assert records.announce_worker(WorkerRecord(peer=peer, stage=announced, phase="weight_sync"), 30.0)
    return dht, records, peer, given, announced, out["credential"]


def test_admission_on_refuses_every_forgery_while_admitted_nodes_train(procs, sample_shards, durable, tmp_path,
                                                                       request):
    key_path, _, key = keys.write_pair(tmp_path / "authority.key")
    env = {**durable, "AGORA_AUTHORITY_KEY": str(key_path)}
    run_dir, port = tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}"
    values = TINY + private_shards(sample_shards, tmp_path) + ADMISSION + SPARTA + MONITOR + [
        "local.trainers=1", "trainers.count=1", f"admission.authorizer={url}", "workers.progress_push=true"]
    authorizer = start_authorizer(procs, values, port, env, tmp_path / "authorizer.err")
    p, status = run_swarm(procs, run_dir, values, timeout=840)

    def admin() -> dict:  # an operator's credential lives 2 minutes: a fresh one per request
        return {"Authorization": "Bearer " + credential.admin_token(key, "local-cpu")}

    s = wait_status(status, p, lambda s: bool(s.get("maddrs")), timeout=300)
    peers = [a for m in s["maddrs"] for a in ("--initial-peers", m)]
    intruder = procs.start(agoractl("launch", "worker", str(MANIFEST), "--stage", "tail",
                                    *sets(values + ["admission.enabled=false", f"checkpoints.store={tmp_path / 'intruder-store'}"]),
                                    *peers),
                           stdout=subprocess.DEVNULL, stderr=open(tmp_path / "intruder.err", "wb"))
    # The Health Monitor, with no authority key: it joins as a monitor and reads the admitted nodes with that.
    health_dir = tmp_path / "health-run"
    health = procs.start(agoractl("launch", "health", str(MANIFEST), *sets(values + [f"local.run_dir={health_dir}"]),
                                  *peers),
                         env={k: v for k, v in os.environ.items()
                              if k not in ("AGORA_AUTHORITY_KEY", "AGORA_DATABASE_URL")},
                         stdout=subprocess.DEVNULL, stderr=open(tmp_path / "health.err", "wb"))
    db = health_dir / "health" / "health.db"
    s = wait_status(status, p, lambda s: s.get("step", 0) >= 1, timeout=400)
    nodes = httpx.get(url + "/v1/nodes", headers=admin()).json()
    head = next(n["peer_id"] for n in nodes if n["stage"] == "head")
    other_head = next(n["peer_id"] for n in nodes if n["stage"] == "head" and n["peer_id"] != head)
    trainer = next(n["peer_id"] for n in nodes if n["role"] == "trainer")

    def mint(ttl=300.0, k=key, node_id="attacker", peer=None, role="trainer", stage="", **kw):
        return lambda ours: credential.issue(k, run="local-cpu", node_id=node_id, account="x", role=role,
                                             stage=stage, peer_id=peer or ours, ttl_s=ttl, serial=1, **kw)

    httpx.post(url + "/v1/bans", headers=admin(), json={"subject": "evil"}).raise_for_status()
    banned_at = time.monotonic()  # the nodes refresh the published ban list every ttl/8; the monitor's checks first

    # The Health Monitor, from real records: a wrong-stage announcer, then an unadmitted one, then a stall.
    _wait(lambda: _rows(db, "SELECT completed FROM health_trainer_sessions WHERE completed > 0"), 120,
          "the monitor counting progress", p)
    from agoractl.runtime import node, peer_auth
    from agoractl.runtime.records import WorkerRecord

    rogue_dht, records, rogue, given, announced, rogue_token = misannouncing_node(values, s["maddrs"], url)
    request.addfinalizer(lambda: node.shutdown_dht(rogue_dht))
    t0 = time.time()
    _wait(lambda: _alert(db, "wrong_stage_announcer", rogue, t0), 30, "wrong_stage_announcer", p)
    wrong_stage_after = time.time() - t0
    t0 = time.time()
    httpx.post(url + "/v1/leave", json={"credential": rogue_token, "peer_id": rogue}).raise_for_status()
    _wait(lambda: _alert(db, "unadmitted_announcer", rogue, t0), 30, "unadmitted_announcer", p)
    unadmitted_after = time.time() - t0
    trainer_pid = next(n["pid"] for n in s["nodes"] if n["name"] == "trainer-0")
    _wait(lambda: not _rows(db, "SELECT id FROM health_alerts WHERE kind = 'progress_stalled' AND resolved_at IS NULL"),
          60, "no stall alert before the trainer stops", p)
    t_stop = time.time()
    os.kill(trainer_pid, signal.SIGSTOP)  # its python only: its DHT process and p2pd stay up
    try:
        _wait(lambda: _alert(db, "progress_stalled", "run", t_stop), STALL_S + 30, "progress_stalled", p)
        stalled_after = time.time() - t_stop
    finally:
        os.kill(trainer_pid, signal.SIGCONT)
    print(f"MEASURED wrong_stage_after_s={wrong_stage_after:.2f} unadmitted_after_s={unadmitted_after:.2f} "
          f"stalled_after_stop_s={stalled_after:.2f} (interval {INTERVAL_S:g}, stall_after {STALL_S:g})")
    assert wrong_stage_after <= 2 * INTERVAL_S + 2.0 and unadmitted_after <= 2 * INTERVAL_S + 2.0
    assert stalled_after <= STALL_S + 2 * INTERVAL_S + 2.0, stalled_after

    time.sleep(max(0.0, banned_at + TTL / 8 + 3 - time.monotonic()))
    tokens = {"missing": None,
              "forged": lambda ours: credential.tampered(mint()(ours), role="trainer", expires_at=9e12),
              "other_authority": mint(k=keys.generate()),
              "wrong_peer": mint(peer=trainer),
              "expired": mint(ttl=-1),
              "banned": mint(node_id="evil")}
    errors = asyncio.run(attack(s["maddrs"], "local-cpu", head, tokens))
    for reason, errs in errors.items():
        assert len(errs) == ATTEMPTS and all(f"credential refused: {reason}" in e for e in errs), (reason, errs)

    # The averaging RPCs of a head worker, dialled directly: credentials a head worker would need, each spoiled.
    worker = dict(role="worker", stage="head")
    averaging_tokens = {"missing": None,
                        "forged": lambda ours: credential.tampered(mint(**worker)(ours), expires_at=9e12),
                        "other_authority": mint(k=keys.generate(), **worker),
                        "wrong_peer": mint(peer=other_head, **worker),
                        "expired": mint(ttl=-1, **worker),
                        "banned": mint(node_id="evil", **worker),
                        "wrong_stage": mint(role="worker", stage="tail")}
    avg_errors = asyncio.run(averaging_attack(head, s["maddrs"], averaging_tokens,
                                              prefix=averager_prefix("local-cpu", "head", "sparta"),
                                              attempts=ATTEMPTS))
    for reason in averaging_tokens:
        for rpc in RPCS:
            errs = avg_errors[f"{reason}:{rpc}"]
            assert len(errs) == ATTEMPTS and refused_every_time(errs, reason), (reason, rpc, errs)

    # DHT records from the same node with each spoiled credential in its validator, announcing it as serving the
    # stage it was given: every admitted node drops them, on store and on read, and counts them; the trainer never
    # sees it (checked at the end). Neither a store's result (the intruder, admission off, keeps anything) nor a
    # read through this node (hivemind caches what it stored) would say so.
    dht_tokens = {"missing": None, "forged": credential.tampered(rogue_token, expires_at=9e12),
                  "other_authority": mint(k=keys.generate(), **worker)(rogue),
                  "wrong_peer": mint(peer=other_head, **worker)(rogue), "expired": mint(ttl=-1, **worker)(rogue),
                  "banned": mint(node_id="evil", **worker)(rogue)}
    for reason, token in dht_tokens.items():
        peer_auth.push(rogue_dht, token, frozenset())
        for _ in range(ATTEMPTS):
            records.announce_worker(WorkerRecord(peer=rogue, stage=given, phase="active"), 30.0)
    node.shutdown_dht(rogue_dht)

    # SIGKILL of the Authorizer mid-run, with a node waiting in its queue; started again on the same state.
    queued = httpx.post(url + "/v1/join", json={"node_id": "waiting", "role": "worker", "peer_id": "1" * 46,
                                                "ready": False}).json()
    assert queued["status"] == "queued", queued
    before = {n["node_id"]: n for n in httpx.get(url + "/v1/nodes", headers=admin()).json()}
    os.kill(authorizer.pid, signal.SIGKILL)
    authorizer.wait(30)
    killed_at, step_at_kill = time.monotonic(), json.loads(status.read_text()).get("step", 0)
    start_authorizer(procs, values, port, env, tmp_path / "authorizer.err")
    outage_s = time.monotonic() - killed_at
    assert outage_s < 3 / 8 * TTL, f"the Authorizer took {outage_s:.0f} s to restart: credentials ran out meanwhile"
    after = {n["node_id"]: n for n in httpx.get(url + "/v1/nodes", headers=admin()).json()}
    assert {k: (n["status"], n["stage"], n["peer_id"]) for k, n in after.items()} == \
           {k: (n["status"], n["stage"], n["peer_id"]) for k, n in before.items()}, (before, after, outage_s)
    assert "evil" in httpx.get(url + "/v1/bans").json()["bans"]
    assert httpx.get(url + "/v1/report", headers=admin()).json()["queue_length"] >= 1
    admitted = [k for k, n in before.items() if n["status"] == "admitted"]
    assert {before[k]["role"] for k in admitted} == {"worker", "trainer", "monitor"}, before
    deadline, renewed, now = time.monotonic() + TTL, [], after
    while time.monotonic() < deadline and p.poll() is None:  # every admitted node renews through the new process
        now = {n["node_id"]: n for n in httpx.get(url + "/v1/nodes", headers=admin()).json()}
        renewed = [k for k in admitted if now[k]["expires_at"] > before[k]["expires_at"]]
        if len(renewed) == len(admitted):
            break
        time.sleep(1)
    step_renewed = json.loads(status.read_text()).get("step", 0)
    assert len(renewed) == len(admitted), (before, now, outage_s)
    assert all(now[k]["status"] == "admitted" for k in renewed), now
    assert step_renewed > step_at_kill, (step_at_kill, step_renewed)  # trained on through the outage
    print(f"authorizer outage {outage_s:.1f} s; steps {step_at_kill} at the kill, {step_renewed} when "
          f"{len(renewed)}/{len(admitted)} nodes had renewed")

    # Trains on with the renewed credentials; then Ctrl-C.
    wait_status(status, p, lambda s: s.get("step", 0) >= step_renewed + 10, timeout=300)
    p.send_signal(signal.SIGINT)
    try:
        p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the swarm did not stop; stderr:\n{err_tail(run_dir)}")
    assert p.returncode == 130, err_tail(run_dir)
    report = json.loads((run_dir / "swarm-report.json").read_text())
    assert report["steps"] >= step_renewed + 10, report["steps"]
    # The honest SPARTA rounds went on through the attacks and the outage: every round complete but the one
    # Ctrl-C cancels (its record fails on each of the stage's 2 workers, as measured); that no gate refused an
    # honest peer is checked below, on every worker's counts.
    for stage in report["stages"]:
        assert stage["averaging_rounds"] >= 3 and stage["rounds_failed"] <= 2, stage
    print("MEASURED steps", report["steps"], "averaging", {st["name"]: (st["averaging_rounds"], st["rounds_failed"],
                                                                       st["averaging_success_mean"])
                                                         for st in report["stages"]})
    intruder.terminate()
    intruder.wait(30)
    intruder_tail = re.findall(r'"peer": "(\w+)"', (tmp_path / "intruder.err").read_text())
    workers = [json.loads(f.read_text()) for f in (run_dir / "swarm" / "nodes").glob("worker-*")]
    refused = next(w for w in workers if w["peer"] == head)["admission"]["refused"]
    for reason in tokens:
        assert refused.get(f"stage_rpc:{reason}", 0) >= ATTEMPTS, refused
    surfaces = {"credential": "averaging_credential", "join": "averaging_join", "part": "averaging_part",
                "state": "averaging_state"}
    expected = {f"{surfaces[rpc]}:{reason}": ATTEMPTS for reason in averaging_tokens for rpc in RPCS}
    for w in workers:  # exactly the rogue's attempts, on the head worker it dialled: no honest peer was refused
        got = {k: n for k, n in w["admission"]["refused"].items() if k.startswith("averaging_")}
        assert got == (expected if w["peer"] == head else {}), (w["peer"], got)
    assert all(w["admission"]["renewals"] >= 1 for w in workers), workers
    for w in workers:  # the replicas' progress pushes carried credentials their peers took, renewals and all; the
        # intruder's (a tail worker with admission off) carried none
        pushes = {k: n for k, n in w["admission"]["refused"].items() if k.startswith("progress_push:")}
        assert w["progress_push"]["received"] > 0, (w["peer"], w["progress_push"])
        assert set(pushes) <= ({"progress_push:missing"} if w["stage"] == "tail" else set()), (w["peer"], pushes)
    trainer_stats = json.loads((run_dir / "swarm" / "nodes" / "trainer-0.json").read_text())
    seen = trainer_stats["stages"]["tail"]["workers_seen"]
    assert len(seen) == 2 and not any(seen_peer.endswith(t) for seen_peer in seen for t in intruder_tail), \
        (seen, intruder_tail)
    assert all(rogue not in trainer_stats["stages"][st]["workers_seen"] for st in (given, announced))
    dht_refused = {k for f in (run_dir / "swarm" / "nodes").glob("*.json")
                   for k in (json.loads(f.read_text()).get("admission") or {}).get("refused", {}) if k.startswith("dht:")}
    assert {f"dht:{reason}" for reason in dht_tokens} <= dht_refused, dht_refused  # counted where dropped
