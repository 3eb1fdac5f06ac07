"""The Dashboard's caching for a public page, over real HTTP (uvicorn on loopback) against the two-run database
fixture on SQLite: 200 concurrent requests to each endpoint read the database once per endpoint (counted as
connections checked out of the engine's pool, and as the cache's computations), every answer carries
Cache-Control and an ETag, a matching If-None-Match gets 304 with no body, and after the cache period (a clock
the test advances) a second burst (20 each) reads the database exactly once more per endpoint.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/services/dashboard/test_cache.py -q -s
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from sqlalchemy import event

from agoractl.services.authorizer import db as authorizer_db
from agoractl.services.authorizer.server import Background
from agoractl.services.dashboard.app import create_app
from tests.services.dashboard.conftest import dashboard_run, fill

pytestmark = pytest.mark.timeout(180)
ENDPOINTS = ["/api/runs", *(f"/api/runs/alpha/{k}" for k in ("loss", "throughput", "nodes", "leaderboard", "stages",
                                                              "eval"))]
"""Every endpoint that reads the database (telemetry reads only Prometheus)."""
REQUESTS = 200
CACHE_S = 5.0


async def burst(url: str, path: str, n: int) -> tuple[float, list[httpx.Response]]:
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=50)) as c:
        t0 = time.monotonic()
        got = await asyncio.gather(*(c.get(path) for _ in range(n)))
        return time.monotonic() - t0, got


def test_one_read_per_endpoint_per_period_and_304(tmp_path):
    engine = authorizer_db.engine_for(f"sqlite:///{tmp_path / 'health.db'}")
    fill(engine)
    reads = {"n": 0}
    event.listen(engine, "checkout", lambda *a: reads.__setitem__("n", reads["n"] + 1))
    now = [0.0]
    app = create_app(dashboard_run(cache_s=CACHE_S), engine, clock=lambda: now[0])
    server = Background(app)
    try:
        for period, n in ((1, REQUESTS), (2, REQUESTS // 10)):  # the next period: one more read, whatever n
            before = reads["n"]
            for path in ENDPOINTS:
                elapsed, got = asyncio.run(burst(server.url, path, n))
                print(f"MEASURED period {period} {path}: {n} concurrent requests in {elapsed:.2f} s")
                assert {r.status_code for r in got} == {200}
                assert {r.headers["etag"] for r in got} == {got[0].headers["etag"]}
                assert got[0].headers["cache-control"] == f"public, max-age={int(CACHE_S)}"
            assert reads["n"] - before == len(ENDPOINTS), (period, reads["n"] - before)
            computed = app.state.cache.computed
            assert all(n == period for n in computed.values()), computed
            now[0] += CACHE_S  # the next period

        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.get("/api/runs/alpha/loss")
            again = c.get("/api/runs/alpha/loss", headers={"If-None-Match": r.headers["etag"]})
            assert (again.status_code, again.content, again.headers["etag"]) == (304, b"", r.headers["etag"])
            assert c.get("/api/runs/alpha/loss", headers={"If-None-Match": '"other"'}).status_code == 200
    finally:
        server.stop()
        engine.dispose()
