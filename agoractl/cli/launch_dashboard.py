"""``agoractl launch dashboard FILE``: the run's public Dashboard. Registered on the ``launch`` group."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Annotated, Optional

import typer

from agoractl.cli.common import ManifestArg, SetOpt, load
from agoractl.cli.launch import app
from agoractl.cli.output import note


@app.command(epilog="Examples:\n\n  agoractl launch dashboard run.yaml --port 8480\n\n"
                    "  AGORA_DATABASE_URL=postgresql://agora@db/agora agoractl launch dashboard run.yaml \\\n"
                    "  --host 0.0.0.0 --prometheus http://prometheus:9090")
def dashboard(
    manifest: ManifestArg,
    set_: SetOpt = None,
    port: Annotated[Optional[int], typer.Option(help="TCP port to listen on (default dashboard.port).",
                                                min=1, max=65535)] = None,
    host: Annotated[Optional[str], typer.Option(help="Address to listen on (default dashboard.host).")] = None,
    prometheus: Annotated[Optional[str], typer.Option(
        help="Prometheus base URL for live telemetry (default dashboard.prometheus_url).")] = None,
    screenshot: Annotated[Optional[Path], typer.Option(
        help="Write a screenshot of the page (PNG; Playwright and /usr/bin/chromium) and exit instead of serving; "
             "without --port on any free port.", show_default=False)] = None,
) -> None:
    """The Dashboard (report §3.6.4): a web page at / and a JSON API under /api/ with every run in the Health
    Monitor's database (monitoring.database_url, else AGORA_DATABASE_URL, else SQLite under local.run_dir/health):
    loss, tokens/s and efficiency, nodes and their status, the contribution leaderboard, SPARTA health per stage.
    Responses are cached for dashboard.cache_s (ETag, 304). Reads the database and Prometheus, never the DHT.
    Serves until Ctrl-C. `launch swarm` starts it itself with dashboard.enabled (and monitoring.enabled)."""
    run = load(manifest, [*(set_ or []), *([f"dashboard.prometheus_url={prometheus}"] if prometheus else [])])
    from agoractl.runtime import node
    from agoractl.services.authorizer.server import serve  # uvicorn
    from agoractl.services.dashboard.app import create_app  # fastapi, sqlalchemy: not for workers
    from agoractl.services.health.db import database_url, open_database

    node.watch_parent(threading.Event(), grace_s=1.0)  # started by `launch swarm`: gone with the launcher
    engine = open_database(run)
    host_, port_ = host or run.dashboard.host, run.dashboard.port if port is None else port
    if screenshot is not None:
        try:
            _screenshot(create_app(run, engine), host_, port if port is not None else 0, screenshot,
                        f"http://{host_}:{port_}/")
        finally:
            engine.dispose()
        return
    note(f"dashboard: http://{host_}:{port_}/ (run {run.metadata.name}, database {database_url(run)}, "
         f"Prometheus {run.dashboard.prometheus_url or 'none'})")
    try:
        serve(create_app(run, engine), host_, port_)
    finally:
        engine.dispose()


def _screenshot(app, host: str, port: int, path: Path, serve_url: str) -> None:
    """Serve APP on host:port (0: any free one) in this process while Chromium takes the screenshot."""
    from agoractl.services.authorizer.server import Background
    from agoractl.services.dashboard import screenshot

    server = Background(app, host, port)
    try:
        url = server.url.replace("://0.0.0.0:", "://127.0.0.1:") + "/"
        screenshot.take(url, path)
    finally:
        server.stop()
    note(f"dashboard: screenshot of {url} written to {path}")
    print(f"dashboard: {serve_url} (`agoractl launch dashboard FILE` serves it); screenshot {path}", flush=True)
