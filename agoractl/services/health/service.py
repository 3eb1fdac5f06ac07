"""``agoractl launch health``: the Health Monitor as a node of the run. It joins the DHT as a client (with the
run's record validator when admission is on), and every ``monitoring.interval_s`` reads the run's records into
the database (:class:`.monitor.Monitor`). With admission on it also asks the Authorizer which nodes are admitted
to which stage (``GET /v1/nodes`` with an admin credential signed by the authority key in
``$AGORA_AUTHORITY_KEY``: the monitor is an operator's node), for the announcer checks; without that key those
two checks are off (said once in the log)."""

from __future__ import annotations

import os
import threading
import time
from typing import Optional, Sequence

from agoractl import logs
from agoractl.auth import keys
from agoractl.errors import AgoraError
from agoractl.manifest.schema import Run
from agoractl.runtime import node
from agoractl.runtime.records import RunRecords
from agoractl.services.authorizer.client import AdminClient
from agoractl.services.health.db import database_url, open_database  # noqa: F401 (database_url: the CLI's)
from agoractl.services.health.monitor import Monitor, read

def admitted_source(run: Run):
    """A callable returning {peer id: stage} of the admitted nodes, or None when that cannot be known."""
    url = run.admission.authorizer
    if not run.admission.enabled:
        return None
    if not os.environ.get(keys.KEY_ENV) or not url:
        logs.get("health").warning("announcer checks off: admission is on but no authority key or Authorizer URL",
                                   hint=f"set {keys.KEY_ENV} and admission.authorizer")
        return None
    last: dict = {}

    def fetch() -> Optional[dict]:
        try:
            nodes = AdminClient(run, url.rstrip("/")).call("GET", "/v1/nodes")
            last.clear()
            last.update({n["peer_id"]: n.get("stage") for n in nodes if n.get("status") == "admitted"})
        except AgoraError as e:
            logs.get("health").warning("Authorizer unreachable; using the last list of admitted nodes", error=str(e))
        return dict(last)

    return fetch


def serve(run: Run, initial_peers: Sequence[str], stop: threading.Event, ticks: Optional[int] = None) -> int:
    """Read the run every interval until STOP (or TICKS intervals); returns the intervals done."""
    peers = node.require_peers(initial_peers, "health monitor")
    engine = open_database(run)
    try:
        dht = node.start_dht(run, peers, client_mode=True)
    except BaseException:
        engine.dispose()
        raise
    log = logs.get("health")
    logs.bind(run=run.metadata.name, role="health", peer=dht.peer_id.to_base58()[-8:])
    records, stages, admitted = RunRecords(dht, run.metadata.name), run.stage_names(), admitted_source(run)
    monitor, done = Monitor(run, engine), 0
    log.info("health monitor up", database=engine.url.render_as_string(hide_password=True),
             interval_s=run.monitoring.interval_s)
    try:
        while not stop.is_set() and (ticks is None or done < ticks):
            t0 = time.monotonic()
            try:
                monitor.tick(read(records, stages, admitted))
                done += 1
            except Exception as e:  # one failed read (DHT timeout, database hiccup) is not the end
                log.warning("interval failed", error=f"{type(e).__name__}: {e}")
            stop.wait(max(0.0, run.monitoring.interval_s - (time.monotonic() - t0)))
        if stop.is_set():  # one last read on the way out: the trainers' final reports
            try:
                monitor.tick(read(records, stages, admitted))
                done += 1
            except Exception as e:
                log.warning("last interval failed", error=f"{type(e).__name__}: {e}")
    finally:
        node.shutdown_dht(dht)
        engine.dispose()
    return done
