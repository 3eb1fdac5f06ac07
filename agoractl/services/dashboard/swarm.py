"""The Dashboard of ``launch swarm`` with ``dashboard.enabled`` (and ``monitoring.enabled``): started by the swarm
as a utility node (``agoractl launch dashboard``) beside the Health Monitor, on the monitor's database and the
swarm's Prometheus; started again if it dies, stopped with the monitor."""

from __future__ import annotations

import errno
import socket
from typing import Callable

from agoractl.errors import RuntimeFailure
from agoractl.manifest.schema import Run

KIND = "dashboard"


def url(run: Run) -> str:
    """Where a browser on this machine reaches it (a wildcard listening address is reached on loopback)."""
    host = run.dashboard.host
    host = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
    return f"http://{host}:{run.dashboard.port}/"


def check_port(run: Run) -> None:
    """A one-line failure before anything starts when dashboard.host:dashboard.port is taken."""
    d = run.dashboard
    family = socket.AF_INET6 if ":" in d.host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((d.host, d.port))
        except OSError as e:
            why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise RuntimeFailure(f"dashboard.port {d.port} on {d.host} {why}",
                                 hint="set dashboard.port to a free port (--set dashboard.port=N)") from None


def for_swarm(run: Run, set_: list[str], prometheus_url: str, note: Callable[[str], None]) -> list[str]:
    """The overrides for the swarm's nodes (the Dashboard reads this Prometheus); prints its URL."""
    note(f"dashboard: {url(run)} (on the health database and Prometheus {prometheus_url}, beside the Health Monitor)")
    return [*set_, f"dashboard.prometheus_url={prometheus_url}"]
