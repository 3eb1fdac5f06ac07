"""Schema migrations run by several processes at once on one database (a swarm starts the Health Monitor and the
Dashboard together, each migrating the monitor's database): every process succeeds and the schema ends at head,
on a SQLite file and on the machine's PostgreSQL (a database of the test's own, dropped after).

Each process is a real interpreter that waits for a common instant, then migrates the Authorizer's and the Health
Monitor's schemas (they share the database, each with its own version table).
"""

from __future__ import annotations

import subprocess
import sys
import time

from sqlalchemy import inspect

from agoractl.services.authorizer.db import engine_for
from tests.conftest import ROOT
from tests.services.conftest import pg_database

PROCESSES = 4

MIGRATE = """
import sys, time
from agoractl.services.authorizer import db as authorizer_db
from agoractl.services.health import db as health_db
engine = authorizer_db.engine_for(sys.argv[1])
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
health_db.migrate(engine)
authorizer_db.migrate(engine)
"""


def migrate_at_once(url: str) -> list[subprocess.CompletedProcess]:
    at = time.time() + 4.0  # every interpreter has imported and connected by then
    procs = [subprocess.Popen([sys.executable, "-c", MIGRATE, url, str(at)], cwd=ROOT, stderr=subprocess.PIPE,
                              text=True) for _ in range(PROCESSES)]
    try:
        return [subprocess.CompletedProcess(p.args, p.wait(120), None, p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def assert_at_head(url: str, results: list[subprocess.CompletedProcess]) -> None:
    failed = [r.stderr.strip().splitlines()[-1:] for r in results if r.returncode != 0]
    assert not failed, failed
    engine = engine_for(url)
    try:
        tables = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert {"health_alembic_version", "alembic_version", "health_snapshots"} <= tables, tables


def test_concurrent_migrations_of_a_sqlite_file(tmp_path):
    url = f"sqlite:///{tmp_path / 'health.db'}"
    assert_at_head(url, migrate_at_once(url))


def test_concurrent_migrations_of_a_postgres_database():
    with pg_database("agora_migrate") as url:
        assert_at_head(url, migrate_at_once(url))
