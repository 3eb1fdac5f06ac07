"""The durable record's connection: an engine for PostgreSQL (``postgresql://``, driven by psycopg 3) or
SQLite, brought to the newest schema by Alembic before the service answers."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import ArgumentError, OperationalError

from agoractl.errors import RuntimeFailure, UsageError

MIGRATIONS = Path(__file__).with_name("migrations")


def engine_for(url: str) -> Engine:
    """An engine for URL (postgresql:// is driven by psycopg 3); one-line errors on a bad URL."""
    if url.startswith(("postgresql://", "postgres://")):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    try:
        if url.startswith("sqlite"):
            eng = create_engine(url, connect_args={"check_same_thread": False, "timeout": 60}, pool_size=20,
                                max_overflow=40, pool_timeout=120)
            event.listen(eng, "connect", _sqlite_pragmas)
            return eng
        return create_engine(url, pool_size=20, max_overflow=40, pool_timeout=120, pool_pre_ping=True)
    except (ArgumentError, ModuleNotFoundError) as e:
        raise UsageError(f"AGORA_DATABASE_URL: {e}",
                         hint="use postgresql://user@host:port/db or sqlite:///path/authorizer.db") from None


def _sqlite_pragmas(conn, _record) -> None:
    """WAL with synchronous=NORMAL: a killed Authorizer loses no committed row (only a power cut could)."""
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")


def migrate(engine: Engine, migrations: Path = MIGRATIONS) -> None:
    """Run the Alembic migrations in MIGRATIONS (the Authorizer's by default) up to head on ENGINE (idempotent)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations))
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    except OperationalError as e:
        raise RuntimeFailure(f"database {engine.url.render_as_string(hide_password=True)}: "
                             f"{str(e.orig).strip().splitlines()[0]}",
                             hint="check AGORA_DATABASE_URL and that the database server is running") from None
