"""Limits under concurrency, over real HTTP: 100 simultaneous joins never admit more than max_contributors,
admissions over a window stay within the rate limit, and placement spreads contributors evenly over the
stages they may use. The 100 joins run against PostgreSQL + Redis (the production back end; the contract suite
covers the embedded one), the others against both."""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from agoractl.auth import credential
from agoractl.manifest.schema import Run

GOOD = {"hardware": {"ram_gb": 128, "vram_gb": 80}, "measurements": {"bandwidth_mbps": 1000, "latency_ms": 10}}


def body(i: int) -> dict:
    return {"node_id": f"n{i}", "role": "worker", "peer_id": f"12D3KooW{i}x".replace("0", "z"), "ready": True, **GOOD}


def test_100_concurrent_joins_never_exceed_max_contributors(pg_backend):
    backend = pg_backend
    s = backend.start(Run.model_validate({"admission": {"max_contributors": 7, "joins_per_minute": 60000}}))
    barrier = threading.Barrier(100)

    def one(i: int) -> dict:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            barrier.wait()
            return c.post("/v1/join", json=body(i)).json()

    with ThreadPoolExecutor(100) as pool:
        out = list(pool.map(one, range(100)))
    statuses = collections.Counter(r["status"] for r in out)
    assert statuses == {"admitted": 7, "queued": 93}, statuses
    assert {r["reason"] for r in out if r["status"] == "queued"} == {"capacity"}
    hdr = {"Authorization": "Bearer " + credential.admin_token(backend.key, "run")}
    assert sum(n["status"] == "admitted" for n in s.client.get("/v1/nodes", headers=hdr).json()) == 7


def test_admissions_stay_within_the_rate_limit(backend):
    per_minute, window = 120.0, 4.0
    s = backend.start(Run.model_validate({"admission": {"max_contributors": 1000, "joins_per_minute": per_minute}}))
    admitted_at: list[float] = []
    stop = time.monotonic() + window

    def poll(i: int) -> None:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            while time.monotonic() < stop:
                r = c.post("/v1/join", json=body(i)).json()
                if r["status"] == "admitted":
                    admitted_at.append(time.monotonic())
                    return

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(poll, range(8)))
    elapsed = time.monotonic() - t0
    assert 1 <= len(admitted_at) <= per_minute * elapsed / 60 + 1, (len(admitted_at), elapsed)


def test_contributors_restricted_to_bodies_spread_evenly(backend):
    run = Run.model_validate({
        "model": {"n_layers": 6},
        "stages": [{"role": "head", "layers": 1}, {"role": "body", "layers": 1}, {"role": "body", "layers": 2},
                   {"role": "body", "layers": 1}, {"role": "tail", "layers": 1}],
        "admission": {"contributor_stages": ["body-1", "body-2", "body-3"], "joins_per_minute": 60000,
                      "min_vram_gb": 24}})
    s = backend.start(run)
    bodies = [dict(body(i), hardware={"ram_gb": 128, "vram_gb": 80 if i % 2 else 30}) for i in range(20)]
    with ThreadPoolExecutor(20) as pool:
        out = list(pool.map(lambda b: httpx.post(s.url + "/v1/join", json=b, timeout=120).json(), bodies))
    stages = collections.Counter(r["stage"] for r in out)
    assert all(r["status"] == "admitted" for r in out), out
    assert set(stages) == {"body-1", "body-2", "body-3"}, stages
    assert max(stages.values()) - min(stages.values()) <= 1, stages
