"""The Dashboard's JSON API over real HTTP (uvicorn on loopback) against the two-run database fixture
(conftest.py), on SQLite and PostgreSQL: every endpoint returns exactly what the fixture holds, worked out by
hand: loss points, tokens/s and efficiency, node states and counts, scores and ranks, the latest evaluation; an
unknown run is 404; the page and plotly.js are served. No swarm, no Prometheus (its panels say so).

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/services/dashboard -q
"""

from __future__ import annotations

import httpx
import pytest

from agoractl.services.authorizer.server import Background
from agoractl.services.dashboard.app import create_app
from tests.services.dashboard.conftest import H, T0, dashboard_run

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def api(fixture_db):
    server = Background(create_app(dashboard_run(), fixture_db))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client
    server.stop()


def test_runs(api):
    assert api.get("/api/runs").json() == {"runs": [
        {"run": "alpha", "first_at": T0 + 10, "last_at": T0 + 50, "snapshots": 5, "step": 3, "samples": 12,
         "tokens": 768, "nodes_live": 3},
        {"run": "beta", "first_at": 2000.0, "last_at": 2010.0, "snapshots": 2, "step": 2, "samples": 4,
         "tokens": 256, "nodes_live": 2}]}


def test_loss_points_of_both_runs(api):
    # A point per snapshot whose loss samples grew: (Δ loss_sum / Δ loss_samples) at its time and step.
    assert api.get("/api/runs/alpha/loss").json() == {"run": "alpha", "as_of": T0 + 50, "points": [
        {"at": T0 + 20, "step": 1, "loss": 5.0, "samples": 4}, {"at": T0 + 40, "step": 2, "loss": 4.5, "samples": 4},
        {"at": T0 + 50, "step": 3, "loss": 3.5, "samples": 4}]}
    assert api.get("/api/runs/beta/loss").json()["points"] == [
        {"at": 2000.0, "step": 1, "loss": 5.0, "samples": 2}, {"at": 2010.0, "step": 2, "loss": 4.5, "samples": 2}]


def test_throughput_and_efficiency(api):
    # 256 tokens per 10 s; pooled: the two present workers' gpu-a (100) + gpu-b (156) TFLOP/s.
    got = api.get("/api/runs/alpha/throughput").json()
    assert got["pooled_tflops"] == 256.0
    assert [(p["at"], p["tokens_per_s"], p["efficiency"]) for p in got["points"]] == [
        (T0 + 20, 25.6, 0.1), (T0 + 30, 0.0, 0.0), (T0 + 40, 25.6, 0.1), (T0 + 50, 25.6, 0.1)]
    # Over the last minute: 768 tokens from T0 + 10 to T0 + 50; 19.2 / 256 = 0.075 tokens per TFLOP.
    assert got["recent"] == {"window_s": 60.0, "tokens_per_s": 19.2, "efficiency": 0.075}
    beta = api.get("/api/runs/beta/throughput").json()  # its worker's hardware is unknown: no efficiency
    assert beta["pooled_tflops"] is None and [p["efficiency"] for p in beta["points"]] == [None]


def test_nodes_with_status_account_and_counts(api):
    got = api.get("/api/runs/alpha/nodes").json()
    rows = [(n["node"], n["status"], n["kind"], n["stage"], n["account"], n["accelerator"], n["last_seen"])
            for n in got["nodes"]]
    assert rows == [("QmBody", "syncing", "worker", "body-1", "bob", "gpu-b", T0 + 1.5 * H),
                    ("QmHead", "active", "worker", "head", "alice", "gpu-a", T0 + 2 * H),
                    ("QmTail", "left", "worker", "tail", "alice", "gpu-a", T0 + H),
                    ("QmTrainer", "active", "trainer", None, None, None, T0 + 2 * H),
                    ("QmNew", "admitted", "worker", "body-1", "carol", "gpu-b", None)]
    assert got["counts"] == {"active": {"head": 1, "trainer": 1}, "syncing": {"body-1": 1}, "left": {"tail": 1},
                             "admitted": {"body-1": 1}}
    assert got["live"] == 3
    assert all(n["region"] is None for n in got["nodes"])  # the Authorizer records no region
    beta = api.get("/api/runs/beta/nodes").json()  # not the dashboard's run: no Authorizer rows shown
    assert [(n["node"], n["status"]) for n in beta["nodes"]] == [("QmBetaHead", "active"), ("QmBetaTrainer", "active")]


def test_leaderboard_scores(api):
    # 10 points per PFLOP (samples x FLOPs per sample) + 2 per hour present (joined..left, open stays to last seen).
    got = api.get("/api/runs/alpha/leaderboard").json()
    assert [(n["rank"], n["node"], n["account"], n["pflops"], n["hours"], n["score"]) for n in got["nodes"]] == [
        (1, "QmHead", "alice", 2.0, 2.0, 24.0), (2, "QmTail", "alice", 2.0, 1.0, 22.0),
        (3, "QmBody", "bob", 1.5, 1.0, 17.0), (4, "QmTrainer", "unknown", 0.0, 2.0, 4.0)]
    assert [(a["rank"], a["account"], a["nodes"], a["score"]) for a in got["accounts"]] == [
        (1, "alice", 2, 46.0), (2, "bob", 1, 17.0), (3, "unknown", 1, 4.0)]
    beta = api.get("/api/runs/beta/leaderboard").json()
    assert [(n["node"], n["score"]) for n in beta["nodes"]] == [("QmBetaHead", 4.0), ("QmBetaTrainer", 2.0)]


def test_stages_eval_and_unknown_run(api):
    stages = api.get("/api/runs/alpha/stages").json()
    assert stages["stages"]["tail"] == {"workers": 1, "serving": 1, "phases": {"active": 1}, "step": 3}
    assert "no Prometheus" in stages["sparta"]["error"]
    assert api.get("/api/runs/alpha/eval").json()["eval"] == {"step": 20, "loss": 3.5, "perplexity": 33.115,
                                                              "tokens": 4096, "at": T0 + 45}
    assert api.get("/api/runs/beta/eval").json()["eval"] is None
    assert "error" in api.get("/api/runs/alpha/telemetry").json()
    assert api.get("/api/runs/gamma/loss").status_code == 404
    assert api.get("/api/runs/gamma/telemetry").status_code == 404
    assert api.get("/api/runs/alpha/telemetry", params={"instance": "not-an-instance"}).status_code == 422


def test_page_and_charting_library(api):
    page = api.get("/")
    assert page.status_code == 200 and '<script src="/static/plotly.min.js">' in page.text
    js = api.get("/static/plotly.min.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert b"plotly.js" in js.content[:2000] and len(js.content) > 1_000_000
