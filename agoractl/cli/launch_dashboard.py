"""``agoractl launch dashboard FILE``: the run's public Dashboard. Registered on the ``launch`` group."""

from __future__ import annotations

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
) -> None:
    """The Dashboard (report §3.6.4): a web page at / and a JSON API under /api/ with every run in the Health
    Monitor's database (monitoring.database_url, else AGORA_DATABASE_URL, else SQLite under local.run_dir/health):
    loss, tokens/s and efficiency, nodes and their status, the contribution leaderboard, SPARTA health per stage.
    Responses are cached for dashboard.cache_s (ETag, 304). Reads the database and Prometheus, never the DHT.
    Serves until Ctrl-C."""
    run = load(manifest, [*(set_ or []), *([f"dashboard.prometheus_url={prometheus}"] if prometheus else [])])
    from agoractl.services.authorizer.server import serve  # uvicorn
    from agoractl.services.dashboard.app import create_app  # fastapi, sqlalchemy: not for workers
    from agoractl.services.health.db import database_url, open_database

    engine = open_database(run)
    host_, port_ = host or run.dashboard.host, run.dashboard.port if port is None else port
    note(f"dashboard: http://{host_}:{port_}/ (run {run.metadata.name}, database {database_url(run)}, "
         f"Prometheus {run.dashboard.prometheus_url or 'none'})")
    try:
        serve(create_app(run, engine), host_, port_)
    finally:
        engine.dispose()
