"""``agoractl launch health FILE``: the run's Health Monitor. Registered on the ``launch`` group."""

from __future__ import annotations

import threading

from agoractl.cli.common import ManifestArg, SetOpt, load
from agoractl.cli.launch import app
from agoractl.cli.launch_nodes import PeersOpt
from agoractl.cli.output import note


@app.command(epilog="Examples:\n\n  agoractl launch health run.yaml --initial-peers /ip4/10.0.0.2/tcp/31337/p2p/Qm...\n\n"
                    "  AGORA_DATABASE_URL=postgresql://agora@db/agora agoractl launch health run.yaml")
def health(manifest: ManifestArg, set_: SetOpt = None, initial_peers: PeersOpt = None) -> None:
    """The Health Monitor (report §3.6.2): joins the run's DHT and every monitoring.interval_s writes its records
    to the database (monitoring.database_url, else AGORA_DATABASE_URL, else SQLite under local.run_dir/health):
    presence per node, verified trainer progress counted once, FLOPs per worker, alerts. Serves until Ctrl-C."""
    run = load(manifest, set_)
    from agoractl.runtime import node
    from agoractl.services.health import service  # sqlalchemy, alembic: not for workers

    stop = threading.Event()
    node.stop_on_signals(stop)
    node.watch_parent(stop)
    note(f"health monitor: run {run.metadata.name}, every {run.monitoring.interval_s:g} s "
         f"(database {service.database_url(run)})")
    service.serve(run, initial_peers or run.network.initial_peers, stop)


def monitoring_stack(run, set_):
    """For `launch swarm` with monitoring.enabled: a push gateway behind the push gate, and a Prometheus server
    scraping the swarm's nodes (each serves /metrics and registers in <run_dir>/monitoring/targets) with the
    shipped alert rules. Returns (stack, overrides for the nodes); prints the URLs. The swarm starts the Health
    Monitor itself (a utility node)."""
    import os
    import secrets
    import shutil
    from pathlib import Path

    from agoractl.runtime.metrics import PUSH_TOKEN_ENV
    from agoractl.services.authorizer.server import Background
    from agoractl.services.health import push_gate
    from agoractl.services.health.db import database_url
    from agoractl.services.health.stack import Stack

    root = Path(run.local.run_dir).resolve() / "monitoring"
    shutil.rmtree(root / "targets", ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    stack = Stack(root)
    try:
        gateway = stack.start_pushgateway()
        os.environ.setdefault(PUSH_TOKEN_ENV, secrets.token_urlsafe(24))  # the nodes inherit it
        gate = Background(push_gate.create_app(run, gateway, run.admission.authority_public_key))
        stack.procs.append(_Stoppable(gate))
        prometheus = stack.start_prometheus(run.monitoring.scrape_interval_s)
    except BaseException:
        stack.stop()
        raise
    note(f"monitoring: Prometheus {prometheus} (alerts {prometheus}/api/v1/alerts), push gateway {gateway} "
         f"(contributors push through {gate.url} with a bearer token), health database {database_url(run)}; "
         f"`agoractl status FILE` summarizes it")
    return stack, [*(set_ or []), "monitoring.metrics_port=0", f"monitoring.targets_dir={stack.targets_dir}"]


class _Stoppable:
    """The push gate (a uvicorn thread) as one of the stack's processes."""

    def __init__(self, server) -> None:
        self.server, self.returncode = server, None

    def poll(self):
        return self.returncode

    def terminate(self) -> None:
        self.server.stop()
        self.returncode = 0

    def wait(self, timeout=None) -> int:
        return 0

    def kill(self) -> None:
        pass
