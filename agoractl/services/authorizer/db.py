"""The durable record's connection: an engine for PostgreSQL (``postgresql://``, driven by psycopg 3) or
SQLite, brought to the newest schema by Alembic before the service answers."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import ArgumentError, OperationalError

from agoractl.errors import RuntimeFailure, UsageError

MIGRATIONS = Path(__file__).with_name("migrations")
MIGRATION_LOCK_KEY = 0x61676F7261  # "agora": the PostgreSQL advisory lock every agoractl migration takes


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
    """Run the Alembic migrations in MIGRATIONS (the Authorizer's by default) up to head on ENGINE (idempotent).

    Processes migrating one database at once (a swarm starts the Health Monitor and the Dashboard together) take
    turns (:func:`_migration_lock`): the later one finds the schema at head instead of creating its tables twice."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations))
    try:
        with _migration_lock(engine), engine.begin() as conn:
            if conn.dialect.name == "postgresql":  # held to the end of the transaction, which commits the schema
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    except OperationalError as e:
        raise RuntimeFailure(f"database {engine.url.render_as_string(hide_password=True)}: "
                             f"{str(e.orig).strip().splitlines()[0]}",
                             hint="check AGORA_DATABASE_URL and that the database server is running") from None


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    """An SQLite file's migrations, one process at a time: an exclusive lock on ``<file>.migrate.lock`` (SQLite
    runs DDL outside a transaction, so two processes could both find no table and both create it). PostgreSQL
    serializes in the transaction itself (an advisory lock, :func:`migrate`); in-memory SQLite has one process."""
    path = engine.url.database if engine.dialect.name == "sqlite" else None
    if not path or path == ":memory:" or path.startswith("file:"):
        yield
        return
    with open(f"{path}.migrate.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
