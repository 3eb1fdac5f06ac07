"""The Authorizer's contract over real HTTP, against both back ends: PostgreSQL + Redis (real servers on
loopback, own database and key prefix) and SQLite + in-process state. Join, queue, checks with their reason
codes, credentials, renewal, bans, accounts, the live policy, the report, and a restart losing nothing."""

from __future__ import annotations

import socket


from agoractl.auth import credential, keys
from agoractl.manifest.schema import Run

GOOD = {"hardware": {"ram_gb": 128, "vram_gb": 80, "accelerator": "H100"},
        "measurements": {"bandwidth_mbps": 1000, "latency_ms": 10}}
PEER = "12D3KooWAbc"


def join(c, node_id, role="worker", peer=PEER, ready=True, **extra):
    body = {"node_id": node_id, "role": role, "peer_id": peer, "ready": ready, **GOOD, **extra}
    return c.post("/v1/join", json=body)


FAST_JOINS = 6e6
"""Joins a minute where a test's joins are not about the rate: a slot every 10 µs. At 6000 a join holds the next
slot for 10 ms, and a second join that comes sooner on a fast run is rate limited, not admitted."""


def admin(s, key=None):
    return {"Authorization": "Bearer " + credential.admin_token(key or s.auth.key, s.auth.run.metadata.name)}


def test_join_queue_admit_renew_leave(backend):
    s = backend.start()
    info = s.client.get("/v1/info").json()
    assert info["stages"] == ["head", "body-1", "tail"] and info["authority"] == keys.key_id(backend.key)
    r = join(s.client, "w1", ready=False)
    assert r.status_code == 200 and r.json()["status"] == "queued" and r.json()["position"] == 0
    assert join(s.client, "w2", peer="12D3KooWDef", ready=False).json()["position"] == 1
    r = join(s.client, "w1").json()
    assert r["status"] == "admitted" and r["stage"] in info["stages"]
    cred = credential.verify(r["credential"], keys.parse_public(info["authority_public_key"]), run="run",
                             peer_id=PEER, role="worker", stage=r["stage"])
    assert cred.node_id == "w1" and cred.serial >= 1
    assert join(s.client, "w2", peer="12D3KooWDef", ready=False).json()["position"] == 0
    r2 = s.client.post("/v1/renew", json={"credential": r["credential"], "peer_id": PEER, "step": 3}).json()
    assert r2["status"] == "admitted" and credential.decode(r2["credential"]).serial > cred.serial
    stolen = s.client.post("/v1/renew", json={"credential": r2["credential"], "peer_id": "12D3KooWThief"})
    assert stolen.status_code == 401 and stolen.json()["reason"] == "invalid_token"
    old = s.client.post("/v1/renew", json={"credential": r["credential"], "peer_id": PEER})
    assert old.status_code == 401  # only the newest credential renews
    assert s.client.post("/v1/leave", json={"credential": r2["credential"], "peer_id": PEER}).json()["ok"]
    nodes = {n["node_id"]: n for n in s.client.get("/v1/nodes", headers=admin(s)).json()}
    assert nodes["w1"]["status"] == "left" and nodes["w2"]["status"] == "queued"


def test_every_check_refuses_with_its_reason(backend):
    s = backend.start()
    h = admin(s)
    r = s.client.post("/v1/join", json={"node_id": "weak", "role": "worker", "peer_id": PEER, "ready": True})
    assert r.status_code == 403 and r.json()["reason"] == "below_requirements"
    s.client.patch("/v1/policy", headers=h,
                   json={"allowed_accelerators": ["H100"], "joins_per_minute": FAST_JOINS}).raise_for_status()
    r = join(s.client, "a100", hardware={"ram_gb": 128, "vram_gb": 80, "accelerator": "A100"})
    assert r.json()["reason"] == "below_requirements" and "accelerator" in r.json()["detail"]
    s.client.patch("/v1/policy", headers=h, json={"checks": {"capability": True, "integrity": True,
                   "reachability": False, "accountability": False}, "allowed_versions": ["0.1.0"]})
    assert join(s.client, "old", client={"version": "0.0.9"}).json()["reason"] == "outdated_client"
    assert join(s.client, "new", client={"version": "0.1.0"}).json()["status"] == "admitted"
    s.client.patch("/v1/policy", headers=h, json={"checks": {"reachability": True, "accountability": True}})
    r = join(s.client, "anon", account="alice")
    assert r.status_code == 401 and r.json()["reason"] == "invalid_token"
    token = s.client.post("/v1/accounts", headers=h, json={"name": "alice"}).json()["token"]
    assert join(s.client, "a1", account="alice", account_token=token + "x").json()["reason"] == "invalid_token"
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    r = join(s.client, "a1", account="alice", account_token=token, client={"version": "0.1.0"},
             multiaddrs=[f"/ip4/127.0.0.1/tcp/{port}"])
    assert r.json()["reason"] == "unreachable"
    with socket.create_server(("127.0.0.1", 0)) as listening:
        addr = f"/ip4/127.0.0.1/tcp/{listening.getsockname()[1]}/p2p/{PEER}"
        r = join(s.client, "a1", account="alice", account_token=token, client={"version": "0.1.0"}, multiaddrs=[addr])
    assert r.json()["status"] == "admitted", r.json()
    s.client.post("/v1/bans", headers=h, json={"subject": "alice", "kind": "account"}).raise_for_status()
    r = join(s.client, "a2", account="alice", account_token=token, multiaddrs=[addr])
    assert r.status_code == 403 and r.json()["reason"] == "banned"
    renew = s.client.post("/v1/renew", json={"credential": join(s.client, "x", peer="12D3KooWX").json().get(
        "credential") or "a.b", "peer_id": PEER})
    assert renew.status_code == 401
    assert "alice" in s.client.get("/v1/bans").json()["bans"]
    for bad in ({"node_id": "n", "role": "boss", "peer_id": PEER}, {"node_id": "", "role": "worker", "peer_id": PEER},
                {"node_id": "n", "role": "worker", "peer_id": "0OIl"}, {"node_id": "n", "role": "worker"}):
        r = s.client.post("/v1/join", json=bad)
        assert r.status_code == 422 and r.json()["reason"] == "malformed"
    assert s.client.post("/v1/join", content=b"{not json").status_code == 422
    reasons = s.client.get("/v1/report", headers=h).json()["reasons"]
    assert reasons["below_requirements"] == 2 and reasons["outdated_client"] == 1 and reasons["banned"] == 1
    assert reasons["invalid_token"] >= 3 and reasons["unreachable"] >= 1 and reasons["malformed"] == 5


def test_admin_endpoints_need_the_authority(backend):
    s = backend.start()
    assert s.client.get("/v1/report").status_code == 401
    assert s.client.get("/v1/report", headers=admin(s, keys.generate())).status_code == 401
    assert s.client.get("/v1/nodes", headers={"Authorization": "Bearer junk"}).status_code == 401
    bad = s.client.patch("/v1/policy", headers=admin(s), json={"max_contributors": -1})
    assert bad.status_code == 400 and "max_contributors" in bad.json()["detail"]
    bad = s.client.patch("/v1/policy", headers=admin(s), json={"contributor_stages": ["nope"]})
    assert bad.status_code == 400 and "contributor_stages" in bad.json()["detail"]


def test_a_monitor_reads_the_nodes_and_takes_no_contributor_slot(backend):
    """The Health Monitor joins with role monitor: admitted with no stage even when every contributor slot is
    taken and without hardware; its credential reads GET /v1/nodes (a worker's does not), nothing else."""
    s = backend.start()
    s.client.patch("/v1/policy", headers=admin(s), json={"max_contributors": 1, "joins_per_minute": FAST_JOINS,
                                                         "min_vram_gb": 8})
    w = join(s.client, "w1").json()
    assert w["status"] == "admitted"
    r = s.client.post("/v1/join", json={"node_id": "mon", "role": "monitor", "peer_id": "12D3KooWMon",
                                        "ready": True}).json()
    assert r["status"] == "admitted" and r["stage"] is None, r
    cred = credential.decode(r["credential"])
    assert (cred.role, cred.stage) == ("monitor", "")
    nodes = s.client.get("/v1/nodes", headers={"Authorization": "Bearer " + r["credential"]})
    assert nodes.status_code == 200 and {n["node_id"]: n["role"] for n in nodes.json()} == {"w1": "worker",
                                                                                          "mon": "monitor"}
    assert s.client.get("/v1/nodes", headers={"Authorization": "Bearer " + w["credential"]}).status_code == 401
    assert s.client.get("/v1/report", headers={"Authorization": "Bearer " + r["credential"]}).status_code == 401
    assert join(s.client, "w2", peer="12D3KooWTwo").json()["reason"] == "capacity"  # the worker's slot holds
    s.client.post("/v1/bans", headers=admin(s), json={"subject": "mon"})
    assert s.client.get("/v1/nodes", headers={"Authorization": "Bearer " + r["credential"]}).status_code == 401


def test_policy_change_applies_to_the_next_request(backend):
    s = backend.start()
    h = admin(s)
    s.client.patch("/v1/policy", headers=h, json={"max_contributors": 1, "joins_per_minute": FAST_JOINS})
    assert join(s.client, "w1").json()["status"] == "admitted"
    r = join(s.client, "w2", peer="12D3KooWTwo").json()
    assert r["status"] == "queued" and r["reason"] == "capacity" and r["position"] == 0
    s.client.patch("/v1/policy", headers=h, json={"max_contributors": 2})
    assert join(s.client, "w2", peer="12D3KooWTwo").json()["status"] == "admitted"
    s.client.patch("/v1/policy", headers=h, json={"max_contributors": 10, "joins_per_minute": 0.5})
    assert join(s.client, "w3", peer="12D3KooWThree").json()["status"] == "admitted"
    r = join(s.client, "w4", peer="12D3KooWFour").json()
    assert r["reason"] == "rate_limited" and r["retry_after_s"] > 60


def test_unrenewed_credentials_free_their_slot(backend):
    s = backend.start()
    s.client.patch("/v1/policy", headers=admin(s), json={"max_contributors": 1, "joins_per_minute": FAST_JOINS,
                                                         "credential_ttl_s": 0.5})
    first = join(s.client, "w1").json()
    assert join(s.client, "w2", peer="12D3KooWTwo").json()["reason"] == "capacity"
    import time

    time.sleep(0.7)
    assert join(s.client, "w2", peer="12D3KooWTwo").json()["status"] == "admitted"
    late = s.client.post("/v1/renew", json={"credential": first["credential"], "peer_id": PEER})
    assert late.status_code == 401
    status = {n["node_id"]: n["status"] for n in s.client.get("/v1/nodes", headers=admin(s)).json()}
    assert status == {"w1": "expired", "w2": "admitted"}


def test_restart_loses_no_node_queue_entry_or_ban(backend):
    run = Run.model_validate({"admission": {"joins_per_minute": FAST_JOINS}})
    s = backend.start(run)
    h = admin(s)
    admitted = join(s.client, "w1").json()
    join(s.client, "w2", peer="12D3KooWTwo", ready=False)
    join(s.client, "w3", peer="12D3KooWThree", ready=False)
    s.client.post("/v1/bans", headers=h, json={"subject": "w3"}).raise_for_status()
    s.client.patch("/v1/policy", headers=h, json={"max_contributors": 5}).raise_for_status()
    backend.stop(s)
    s = backend.start(run)
    nodes = {n["node_id"]: n for n in s.client.get("/v1/nodes", headers=admin(s)).json()}
    assert (nodes["w1"]["status"], nodes["w2"]["status"], nodes["w3"]["status"]) == ("admitted", "queued", "banned")
    assert join(s.client, "w2", peer="12D3KooWTwo", ready=False).json()["position"] == 0
    assert s.client.get("/v1/bans").json()["bans"] == ["w3"]
    renewed = s.client.post("/v1/renew", json={"credential": admitted["credential"], "peer_id": PEER})
    assert renewed.status_code == 200 and renewed.json()["status"] == "admitted"
    if backend.kind == "postgres+redis":  # the live policy lives in Redis; in-process state starts from the manifest
        assert s.client.get("/v1/policy", headers=admin(s)).json()["max_contributors"] == 5


def test_operators_only_until_the_run_reaches_a_step(backend):
    s = backend.start(Run.model_validate({"admission": {"operators_only_until_step": 100,
                                                        "joins_per_minute": FAST_JOINS}}))
    token = s.client.post("/v1/accounts", headers=admin(s), json={"name": "ops", "operator": True}).json()["token"]
    op = join(s.client, "op1", account="ops", account_token=token).json()
    assert op["status"] == "admitted" and credential.decode(op["credential"]).operator
    r = join(s.client, "c1", peer="12D3KooWC").json()
    assert r["status"] == "queued" and r["reason"] == "capacity" and "until step 100" in r["detail"]
    s.client.post("/v1/renew", json={"credential": op["credential"], "peer_id": PEER, "step": 100}).raise_for_status()
    assert join(s.client, "c1", peer="12D3KooWC").json()["status"] == "admitted"
