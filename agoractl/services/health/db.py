"""The monitor's database: PostgreSQL (``postgresql://``, psycopg 3) or SQLite, brought to the newest schema by
its own Alembic migrations (version table ``health_alembic_version``: it may share a database with the
Authorizer). The URL: ``monitoring.database_url``, else ``$AGORA_DATABASE_URL``, else SQLite under the run
directory."""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from agoractl.errors import RuntimeFailure
from agoractl.manifest.schema import Run
from agoractl.services.authorizer.db import engine_for

MIGRATIONS = Path(__file__).with_name("migrations")
DATABASE_ENV = "AGORA_DATABASE_URL"


def database_url(run: Run) -> str:
    if run.monitoring.database_url:
        return run.monitoring.database_url
    if os.environ.get(DATABASE_ENV):
        return os.environ[DATABASE_ENV]
    path = Path(run.local.run_dir) / "health" / "health.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def open_database(run: Run, migrate_schema: bool = True) -> Engine:
    engine = engine_for(database_url(run))
    if migrate_schema:
        migrate(engine)
    return engine


def migrate(engine: Engine) -> None:
    """Run the monitor's Alembic migrations up to head on ENGINE (idempotent)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    except OperationalError as e:
        raise RuntimeFailure(f"database {engine.url.render_as_string(hide_password=True)}: "
                             f"{str(e.orig).strip().splitlines()[0]}",
                             hint="check AGORA_DATABASE_URL and that the database server is running") from None
