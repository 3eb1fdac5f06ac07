"""The Dashboard's FastAPI app: the page at ``/``, the charting library at ``/static/plotly.min.js`` (served from
the installed ``plotly`` package, never copied into the repository), and the JSON API:

- ``GET /api/runs``: the runs the database holds;
- ``GET /api/runs/{run}/loss``: loss points over steps and time;
- ``GET /api/runs/{run}/throughput``: tokens/s over time, pooled TFLOP/s and efficiency η;
- ``GET /api/runs/{run}/nodes``: nodes with status, stage, role, account, region, last seen; counts by status
  and stage; the live count;
- ``GET /api/runs/{run}/leaderboard``: contribution scores and ranks per node and per account;
- ``GET /api/runs/{run}/stages``: per stage serving replicas and step (database), SPARTA rounds and averaging
  success (Prometheus);
- ``GET /api/runs/{run}/telemetry[?instance=I]``: each node's latest gauges (Prometheus);
- ``GET /api/runs/{run}/eval``: validation loss of the latest evaluated checkpoint (null before an eval).

Every API answer goes through :class:`.cache.Cache`: ``Cache-Control: public, max-age=...``, an ``ETag``, ``304``
to a matching ``If-None-Match``, and at most one database (or Prometheus) read per endpoint and query per
``dashboard.cache_s``.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Annotated, Callable, Optional

from fastapi import FastAPI, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, HTMLResponse
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from agoractl.errors import RuntimeFailure
from agoractl.manifest.schema import Run
from agoractl.services.dashboard import prometheus, queries
from agoractl.services.dashboard.cache import Cache, matches
from agoractl.services.dashboard.scores import Weights

PAGE = Path(__file__).with_name("page.html")


def plotly_js() -> Path:
    """plotly.js as the ``plotly`` PyPI package ships it (found without importing the Python package)."""
    spec = importlib.util.find_spec("plotly")
    path = Path(spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else ".")
    path = path / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise RuntimeFailure(f"plotly.js not found at {path} (the dashboard serves it from the plotly package)",
                             hint="pip install -c constraints.txt -e '.[services]' (or `make install`)")
    return path


def create_app(run: Run, engine: Engine, prometheus_url: Optional[str] = None,
               clock: Callable[[], float] = time.monotonic) -> FastAPI:
    cfg = run.dashboard
    prom = prometheus_url or cfg.prometheus_url
    weights = Weights(cfg.score.points_per_pflop, cfg.score.points_per_hour)
    cache = Cache(cfg.cache_s, clock)
    app = FastAPI(title="agoractl dashboard", docs_url=None, redoc_url=None)
    app.state.cache = cache
    page = PAGE.read_text().replace("__REFRESH_MS__", str(int(cfg.refresh_s * 1000)))
    js = plotly_js()

    async def entry_for(key: str, compute):
        """A fresh entry is answered on the event loop; a stale one is computed in a worker thread."""
        return cache.fresh(key) or await run_in_threadpool(cache.get, key, compute)

    async def reply(request: Request, key: str, compute) -> Response:
        entry = await entry_for(key, compute)
        headers = {"ETag": entry.etag, "Cache-Control": f"public, max-age={cache.max_age(entry)}"}
        if entry.status == 200 and matches(request.headers.get("if-none-match"), entry.etag):
            return Response(status_code=304, headers=headers)
        return Response(entry.body, status_code=entry.status, media_type="application/json", headers=headers)

    def from_db(read):
        def compute():
            with Session(engine) as s:  # one connection: one database read
                return read(s)
        return compute

    def runs_compute():
        return from_db(lambda s: {"runs": queries.runs(s)})(), 200

    async def known(name: str) -> bool:
        """Whether NAME is a run of the (cached) run list: an unknown name costs no database read, and the
        cache holds entries for real runs only."""
        return any(r["run"] == name for r in (await entry_for("runs", runs_compute)).value["runs"])

    async def for_run(request: Request, kind: str, name: str, read, then=None) -> Response:
        """READ(session) for a known run, then THEN(value) (e.g. Prometheus) with the connection returned."""
        if not await known(name):
            return Response(json.dumps({"error": f"no run {name!r} in the database"}), status_code=404,
                            media_type="application/json", headers={"Cache-Control": "public, max-age=1"})
        db = from_db(read)
        return await reply(request, f"{kind}:{name}", lambda: ((then or (lambda v: v))(db()), 200))

    @app.get("/", include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": f"public, max-age={int(cfg.cache_s)}"})

    @app.get("/static/plotly.min.js", include_in_schema=False)
    def plotly() -> FileResponse:
        return FileResponse(js, media_type="text/javascript", headers={"Cache-Control": "public, max-age=86400"})

    @app.get("/api/runs")
    async def runs(request: Request) -> Response:
        return await reply(request, "runs", runs_compute)

    @app.get("/api/runs/{name}/loss")
    async def loss(name: str, request: Request) -> Response:
        return await for_run(request, "loss", name, lambda s: queries.loss(s, name))

    @app.get("/api/runs/{name}/throughput")
    async def throughput(name: str, request: Request) -> Response:
        return await for_run(request, "throughput", name,
                             lambda s: queries.throughput(s, name, cfg.accelerator_tflops))

    @app.get("/api/runs/{name}/nodes")
    async def nodes(name: str, request: Request) -> Response:
        return await for_run(request, "nodes", name, lambda s: queries.nodes(s, name, run.metadata.name))

    @app.get("/api/runs/{name}/leaderboard")
    async def leaderboard(name: str, request: Request) -> Response:
        return await for_run(request, "leaderboard", name, lambda s: queries.leaderboard(s, name, weights))

    @app.get("/api/runs/{name}/stages")
    async def stages(name: str, request: Request) -> Response:
        return await for_run(request, "stages", name, lambda s: queries.stages(s, name),
                             lambda out: {**out, "sparta": prometheus.stage_health(prom, name)})

    @app.get("/api/runs/{name}/eval")
    async def evaluation(name: str, request: Request) -> Response:
        return await for_run(request, "eval", name, lambda s: {"run": name, "eval": queries.latest_eval(s, name)})

    @app.get("/api/runs/{name}/telemetry")
    async def telemetry(name: str, request: Request,
                  instance: Annotated[Optional[str], Query(pattern=r"^[0-9a-f]{16}$")] = None) -> Response:
        if not await known(name):
            return await for_run(request, "telemetry", name, None)  # the 404
        return await reply(request, f"telemetry:{name}:{instance or ''}",
                     lambda: ({"run": name, **prometheus.telemetry(prom, name, instance)}, 200))

    return app
