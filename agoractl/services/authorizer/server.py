"""Build and serve an Authorizer from a run manifest and the environment.

``AGORA_DATABASE_URL`` (PostgreSQL; default SQLite under the run directory), ``AGORA_REDIS_URL`` (default
in-process state), ``AGORA_AUTHORITY_KEY`` (the private key's path), ``AGORA_REDIS_PREFIX`` (key prefix,
default ``agora:<run>:``). Never from the manifest: a manifest is shared, these are secrets and local.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import uvicorn
from fastapi import FastAPI

from agoractl.auth import keys
from agoractl.manifest.schema import Run
from agoractl.services.authorizer.api import create_app
from agoractl.services.authorizer.db import engine_for, migrate
from agoractl.services.authorizer.live import MemoryState, RedisState
from agoractl.services.authorizer.service import Authorizer


@dataclass
class Settings:
    database_url: str
    redis_url: Optional[str]
    key_path: Optional[str]
    redis_prefix: str

    @classmethod
    def from_env(cls, run: Run, state_dir: Optional[Path] = None) -> "Settings":
        state = state_dir or Path(run.local.run_dir) / "authorizer"
        db = os.environ.get("AGORA_DATABASE_URL") or f"sqlite:///{state / 'authorizer.db'}"
        return cls(database_url=db, redis_url=os.environ.get("AGORA_REDIS_URL") or None,
                   key_path=os.environ.get(keys.KEY_ENV) or None,
                   redis_prefix=os.environ.get("AGORA_REDIS_PREFIX") or f"agora:{run.metadata.name}:")


def build(run: Run, settings: Settings, key=None) -> tuple[FastAPI, Authorizer]:
    """The app and its Authorizer: key loaded, database migrated, live state connected."""
    key = key or keys.load_private(settings.key_path)
    if settings.database_url.startswith("sqlite:///"):
        Path(settings.database_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = engine_for(settings.database_url)
    migrate(engine)
    live = RedisState(settings.redis_url, settings.redis_prefix) if settings.redis_url else MemoryState()
    auth = Authorizer(run, engine, live, key)
    return create_app(auth), auth


def serve(app: FastAPI, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn's own handling)."""
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


class Background:
    """An app served by uvicorn in a thread of this process (tests, ``launch swarm``)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the Authorizer did not start")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        self.url = f"http://{host}:{sock.getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
