"""Back ends of the Authorizer for tests: the real PostgreSQL (127.0.0.1:5432, trust auth) and Redis
(127.0.0.1:6379) that this kind of machine runs, each test in its own database and key prefix (dropped and
deleted after); and the embedded default, SQLite in tmp_path with in-process state.

``AGORA_TEST_PG`` / ``AGORA_TEST_REDIS`` point elsewhere (a server URL without a database name / a redis URL).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from typing import Iterator

import httpx
import psycopg
import pytest
import redis

from agoractl.auth import keys
from agoractl.manifest.schema import Run
from agoractl.services.authorizer.server import Background, Settings, build

PG = os.environ.get("AGORA_TEST_PG", "postgresql://postgres@127.0.0.1:5432")
REDIS = os.environ.get("AGORA_TEST_REDIS", "redis://127.0.0.1:6379/0")
BACKENDS = ["postgres+redis", "sqlite+memory"]


@contextlib.contextmanager
def pg_database(prefix: str) -> Iterator[str]:
    """A PostgreSQL database of the test's own on the machine's server; yields its URL and drops it after, also
    on failure (connections still open to it are closed)."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(f"{PG}/postgres", autocommit=True, connect_timeout=5) as c:
            c.execute(f'CREATE DATABASE "{name}"')
    except psycopg.Error as e:
        pytest.fail(f"PostgreSQL at {PG} not usable: {e} (set AGORA_TEST_PG to point elsewhere)")
    try:
        yield f"{PG}/{name}"
    finally:
        with psycopg.connect(f"{PG}/postgres", autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class Served:
    url: str
    auth: object
    server: Background
    client: httpx.Client


class Backend:
    """Makes Authorizers on one back end; ``start`` again after ``stop`` is a restart on the same state."""

    def __init__(self, kind: str, tmp_path) -> None:
        self.kind, self.key, self.live = kind, keys.generate(), []
        tag = uuid.uuid4().hex[:12]
        if kind == "postgres+redis":
            self.dbname = f"agora_test_{tag}"
            try:
                with psycopg.connect(f"{PG}/postgres", autocommit=True, connect_timeout=5) as c:
                    c.execute(f'CREATE DATABASE "{self.dbname}"')
                redis.Redis.from_url(REDIS).ping()
            except (psycopg.Error, redis.RedisError) as e:
                pytest.fail(f"PostgreSQL at {PG} / Redis at {REDIS} not usable: {e}; these tests need both "
                            "(set AGORA_TEST_PG / AGORA_TEST_REDIS to point elsewhere)")
            self.settings = Settings(f"{PG}/{self.dbname}", REDIS, None, f"agoratest:{tag}:")
        else:
            self.settings = Settings(f"sqlite:///{tmp_path / tag / 'authorizer.db'}", None, None, "")

    def start(self, run: Run | None = None) -> Served:
        run = run or Run()
        app, auth = build(run, self.settings, key=self.key)
        bg = Background(app)
        served = Served(bg.url, auth, bg, httpx.Client(base_url=bg.url, timeout=60))
        self.live.append(served)
        return served

    def stop(self, served: Served) -> None:
        served.client.close()
        served.server.stop()
        served.auth.live.close()
        served.auth.engine.dispose()
        self.live.remove(served)

    def close(self) -> None:
        for s in list(self.live):
            self.stop(s)
        if self.kind == "postgres+redis":
            r = redis.Redis.from_url(REDIS)
            keys_ = list(r.scan_iter(self.settings.redis_prefix + "*"))
            if keys_:
                r.delete(*keys_)
            r.close()
            with psycopg.connect(f"{PG}/postgres", autocommit=True) as c:
                c.execute(f'DROP DATABASE IF EXISTS "{self.dbname}" WITH (FORCE)')


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    b = Backend(request.param, tmp_path)
    yield b
    b.close()


@pytest.fixture
def pg_backend(tmp_path):
    b = Backend("postgres+redis", tmp_path)
    yield b
    b.close()
