"""The monitor's database: PostgreSQL (``postgresql://``, psycopg 3) or SQLite, brought to the newest schema by
its own Alembic migrations (version table ``health_alembic_version``: it may share a database with the
Authorizer). The URL: ``monitoring.database_url``, else ``$AGORA_DATABASE_URL``, else SQLite under the run
directory."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine

from agoractl.manifest.schema import Run
from agoractl.services.authorizer import db as authorizer_db

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
    engine = authorizer_db.engine_for(database_url(run))
    if migrate_schema:
        migrate(engine)
    return engine


def migrate(engine: Engine) -> None:
    """Run the monitor's Alembic migrations up to head on ENGINE (idempotent)."""
    authorizer_db.migrate(engine, MIGRATIONS)
