"""structlog, configured once per process: console renderer on a terminal, JSON lines otherwise.

Diagnostics go to stderr; data goes to stdout through :mod:`agoractl.cli.output`. Nodes bind their
context (``run``, ``role``, ``stage``, ``peer``) with :func:`bind`.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure(json_lines: bool | None = None, level: str | None = None) -> None:
    """Configure structlog and stdlib logging (idempotent). JSON lines unless stderr is a TTY."""
    global _configured
    if _configured:
        return
    _configured = True
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    lvl = getattr(logging, (level or os.environ.get("AGORA_LOG_LEVEL", "INFO")).upper(), logging.INFO)
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # hivemind and friends log through stdlib logging; keep them quiet unless debugging.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if os.environ.get("AGORA_DEBUG") != "1":
        for name in ("hivemind", "asyncio", "s3fs", "botocore", "urllib3", "fsspec"):
            logging.getLogger(name).setLevel(logging.ERROR)


def reset() -> None:
    """Forget this process's configuration, bound context and stdlib handlers: a node forked from ``launch swarm``
    (:mod:`agoractl.runtime.node_process`) configures its own, for its own stderr (its log file)."""
    global _configured
    _configured = False
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)


def bind(**context) -> None:
    """Bind node context (run, role, stage, peer) to every later log line of this process."""
    structlog.contextvars.bind_contextvars(**context)


def get(name: str | None = None):
    configure()
    return structlog.get_logger(name)
