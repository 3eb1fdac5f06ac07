"""One real swarm with admission on (``admission.enabled: true``; `launch swarm` starts the Authorizer on
loopback and every node joins through it). While it trains, the test attacks it over libp2p from its own
process: stage requests with no credential, a tampered one, one signed by another authority, another peer's,
an expired one and a banned node's are each refused, every time, with their own reason; an unadmitted worker's
DHT records are dropped, so no trainer ever sends it a sample. The admitted nodes train to the last step."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time

import httpx
import pytest
import torch

from agoractl.auth import credential, keys
from tests.conftest import private_shards
from tests.runtime.test_swarm import (MANIFEST, TINY, agoractl, err_tail, finish, procs,  # noqa: F401  (fixture)
                                      run_swarm, sets, wait_status)

pytestmark = pytest.mark.swarm
ATTEMPTS = 3
STEPS = 150
"""Long enough (tens of seconds on 2 cores) that the attacks land while every node still serves."""
ADMISSION = ["admission.enabled=true", "admission.min_vram_gb=0", "admission.min_ram_gb=0",
             "admission.min_bandwidth_mbps=0", "admission.max_latency_ms=10000", "admission.joins_per_minute=6000",
             "admission.credential_ttl_s=20"]


def authorizer_url(err_path) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = re.search(r"authorizer: (http://\S+)", err_path.read_text() if err_path.exists() else "")
        if m:
            return m.group(1)
        time.sleep(0.2)
    pytest.fail("the swarm never printed its Authorizer")


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


def test_admission_on_refuses_every_forgery_while_admitted_nodes_train(procs, sample_shards, tmp_path, monkeypatch):
    key_path, _, key = keys.write_pair(tmp_path / "authority.key")
    monkeypatch.setenv("AGORA_AUTHORITY_KEY", str(key_path))
    run_dir = tmp_path / "run"
    values = TINY + private_shards(sample_shards, tmp_path) + ADMISSION + [
        f"training.max_steps={STEPS}", "local.trainers=1", "trainers.count=1"]
    p, status = run_swarm(procs, run_dir, values, timeout=540)
    url = authorizer_url(tmp_path / "run-swarm.err")
    admin = {"Authorization": "Bearer " + credential.admin_token(key, "local-cpu")}
    s = wait_status(status, p, lambda s: bool(s.get("maddrs")), timeout=300)
    intruder = procs.start(agoractl("launch", "worker", str(MANIFEST), "--stage", "body-1",
                                    *sets(values + ["admission.enabled=false"]),
                                    *[a for m in s["maddrs"] for a in ("--initial-peers", m)]),
                           stdout=subprocess.DEVNULL, stderr=open(tmp_path / "intruder.err", "wb"))
    s = wait_status(status, p, lambda s: s.get("step", 0) >= 1, timeout=400)
    nodes = httpx.get(url + "/v1/nodes", headers=admin).json()
    head = next(n["peer_id"] for n in nodes if n["stage"] == "head")
    trainer = next(n["peer_id"] for n in nodes if n["role"] == "trainer")

    def mint(ttl=300.0, k=key, node_id="attacker", peer=None, **kw):
        return lambda ours: credential.issue(k, run="local-cpu", node_id=node_id, account="x", role="trainer",
                                             stage="", peer_id=peer or ours, ttl_s=ttl, serial=1, **kw)

    httpx.post(url + "/v1/bans", headers=admin, json={"subject": "evil"}).raise_for_status()
    time.sleep(7)  # the workers refresh the published ban list every ttl/4 = 5 s
    tokens = {"missing": None,
              "forged": lambda ours: credential.tampered(mint()(ours), role="trainer", expires_at=9e12),
              "other_authority": mint(k=keys.generate()),
              "wrong_peer": mint(peer=trainer),
              "expired": mint(ttl=-1),
              "banned": mint(node_id="evil")}
    errors = asyncio.run(attack(s["maddrs"], "local-cpu", head, tokens))
    for reason, errs in errors.items():
        assert len(errs) == ATTEMPTS and all(f"credential refused: {reason}" in e for e in errs), (reason, errs)

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
    trainer_stats = json.loads((run_dir / "swarm" / "nodes" / "trainer-0.json").read_text())
    seen = trainer_stats["stages"]["body-1"]["workers_seen"]
    assert len(seen) == 1 and not any(seen[0].endswith(t) for t in intruder_tail), (seen, intruder_tail)
    assert any(k.startswith("dht:") for w in workers.values() for k in w["admission"]["refused"]), err_tail(run_dir)
