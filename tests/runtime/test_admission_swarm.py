"""One real swarm with admission on (``admission.enabled: true``), every node joining through an Authorizer
that the test runs as its own process (`agoractl launch authorizer`) on the real PostgreSQL and Redis. While
it trains, the test attacks it over libp2p from its own process: stage requests with no credential, a tampered
one, one signed by another authority, another peer's, an expired one and a banned node's are each refused,
every time, with their own reason; an unadmitted worker's DHT records are dropped, so no trainer ever sends it
a sample. Then the Authorizer is killed (SIGKILL) and started again on the same database: the nodes train on
meanwhile, no node, queue entry or ban is lost, and every admitted node renews through the new process (the
credentials live 40 s: a node renews every 20 s or so). The admitted nodes train to the last step."""

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

import httpx
import pytest
import torch

from agoractl.auth import credential, keys
from tests.conftest import private_shards
from tests.services.conftest import PG, REDIS
from tests.runtime.test_swarm import (MANIFEST, TINY, agoractl, err_tail, finish, procs,  # noqa: F401  (fixture)
                                      run_swarm, sets, wait_status)

pytestmark = pytest.mark.swarm
ATTEMPTS = 3
STEPS = 150
"""Long enough (tens of seconds on 2 cores) that the attacks land while every node still serves."""
ADMISSION = ["admission.enabled=true", "admission.min_vram_gb=0", "admission.min_ram_gb=0",
             "admission.min_bandwidth_mbps=0", "admission.max_latency_ms=10000", "admission.joins_per_minute=6000",
             "admission.credential_ttl_s=40"]
TTL = 40.0
"""Nodes renew at half-life, so every node renews within TTL/2 of the restart; an outage longer than about
3/8 TTL lets the unluckiest nodes' credentials expire (docs/admission.md), hence the Authorizer's restart
must take less (seconds on an idle machine)."""


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



def test_admission_on_refuses_every_forgery_while_admitted_nodes_train(procs, sample_shards, durable, tmp_path):
    key_path, _, key = keys.write_pair(tmp_path / "authority.key")
    env = {**durable, "AGORA_AUTHORITY_KEY": str(key_path)}
    run_dir, port = tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}"
    values = TINY + private_shards(sample_shards, tmp_path) + ADMISSION + [
        f"training.max_steps={STEPS}", "local.trainers=1", "trainers.count=1", f"admission.authorizer={url}"]
    authorizer = start_authorizer(procs, values, port, env, tmp_path / "authorizer.err")
    p, status = run_swarm(procs, run_dir, values, timeout=540)

    def admin() -> dict:  # an operator's credential lives 2 minutes: a fresh one per request
        return {"Authorization": "Bearer " + credential.admin_token(key, "local-cpu")}

    s = wait_status(status, p, lambda s: bool(s.get("maddrs")), timeout=300)
    intruder = procs.start(agoractl("launch", "worker", str(MANIFEST), "--stage", "body-1",
                                    *sets(values + ["admission.enabled=false", f"checkpoints.store={tmp_path / 'intruder-store'}"]),
                                    *[a for m in s["maddrs"] for a in ("--initial-peers", m)]),
                           stdout=subprocess.DEVNULL, stderr=open(tmp_path / "intruder.err", "wb"))
    s = wait_status(status, p, lambda s: s.get("step", 0) >= 1, timeout=400)
    nodes = httpx.get(url + "/v1/nodes", headers=admin()).json()
    head = next(n["peer_id"] for n in nodes if n["stage"] == "head")
    trainer = next(n["peer_id"] for n in nodes if n["role"] == "trainer")

    def mint(ttl=300.0, k=key, node_id="attacker", peer=None, **kw):
        return lambda ours: credential.issue(k, run="local-cpu", node_id=node_id, account="x", role="trainer",
                                             stage="", peer_id=peer or ours, ttl_s=ttl, serial=1, **kw)

    httpx.post(url + "/v1/bans", headers=admin(), json={"subject": "evil"}).raise_for_status()
    time.sleep(TTL / 8 + 3)  # the nodes refresh the published ban list every ttl/8
    tokens = {"missing": None,
              "forged": lambda ours: credential.tampered(mint()(ours), role="trainer", expires_at=9e12),
              "other_authority": mint(k=keys.generate()),
              "wrong_peer": mint(peer=trainer),
              "expired": mint(ttl=-1),
              "banned": mint(node_id="evil")}
    errors = asyncio.run(attack(s["maddrs"], "local-cpu", head, tokens))
    for reason, errs in errors.items():
        assert len(errs) == ATTEMPTS and all(f"credential refused: {reason}" in e for e in errs), (reason, errs)

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
    deadline, renewed, now = time.monotonic() + TTL, [], after
    while time.monotonic() < deadline and p.poll() is None:  # every admitted node renews through the new process
        now = {n["node_id"]: n for n in httpx.get(url + "/v1/nodes", headers=admin()).json()}
        renewed = [k for k in admitted if now[k]["expires_at"] > before[k]["expires_at"]]
        if len(renewed) == len(admitted):
            break
        time.sleep(1)
    step_renewed = json.loads(status.read_text()).get("step", 0)
    # Every node while the run trains; if it finished first (a fast machine), at least those that renewed by then.
    assert renewed and (p.poll() is not None or len(renewed) == len(admitted)), (before, now, outage_s)
    assert all(now[k]["status"] == "admitted" for k in renewed), now
    assert step_renewed > step_at_kill, (step_at_kill, step_renewed)  # trained on through the outage
    print(f"authorizer outage {outage_s:.1f} s; steps {step_at_kill} at the kill, {step_renewed} when "
          f"{len(renewed)}/{len(admitted)} nodes had renewed")

    report = finish(p, run_dir)
    assert report["steps"] == STEPS, report
    intruder.terminate()
    intruder.wait(30)
    intruder_tail = re.findall(r'"peer": "(\w+)"', (tmp_path / "intruder.err").read_text())
    stats = (json.loads(f.read_text()) for f in (run_dir / "swarm" / "nodes").glob("worker-*"))
    workers = {w["stage"]: w for w in stats}
    refused = workers["head"]["admission"]["refused"]  # the Authorizer placed the workers: names may differ
    for reason in tokens:
        assert refused.get(f"stage_rpc:{reason}", 0) >= ATTEMPTS, refused
    assert all(w["admission"]["renewals"] >= 1 for w in workers.values()), workers
    trainer_stats = json.loads((run_dir / "swarm" / "nodes" / "trainer-0.json").read_text())
    seen = trainer_stats["stages"]["body-1"]["workers_seen"]
    assert len(seen) == 1 and not any(seen[0].endswith(t) for t in intruder_tail), (seen, intruder_tail)
    assert any(k.startswith("dht:") for w in workers.values() for k in w["admission"]["refused"]), err_tail(run_dir)
