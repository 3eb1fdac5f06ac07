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
    peers = node.require_peers(initial_peers or run.network.initial_peers, "health monitor")
    note(f"health monitor: run {run.metadata.name}, every {run.monitoring.interval_s:g} s "
         f"(database {service.database_url(run)})")
    service.serve(run, peers, stop)

