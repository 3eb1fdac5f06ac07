"""``agoractl launch health``: the Health Monitor as a node of the run. It joins the DHT as a client (with the
run's record validator when admission is on), and every ``monitoring.interval_s`` reads the run's records into
the database (:class:`.monitor.Monitor`). With admission on it joins through the Authorizer like any node, with
role ``monitor`` (no stage, no contributor slot, renewed like every credential), and with that credential asks
the Authorizer every interval which nodes are admitted to which stage (``GET /v1/nodes``), for the announcer
checks. Refused by the Authorizer, it stops with the refusal (exit 1); with no Authorizer URL those two checks
are off (said once in the log)."""

from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import httpx

from agoractl import logs
from agoractl.manifest.schema import Run
from agoractl.runtime import admission, node
from agoractl.runtime.records import RunRecords
from agoractl.services.health.db import database_url, open_database  # noqa: F401 (database_url: the CLI's)
from agoractl.services.health.monitor import Monitor, read


def admitted_source(run: Run, dht):
    """A callable returning {peer id: stage} of the admitted nodes (None when that cannot be known), and the
    monitor's admission (None when admission is off). Joins the run as a ``monitor`` through the Authorizer."""
    url = (run.admission.authorizer or "").rstrip("/")
    if not run.admission.enabled:
        return None, None
    if not url:
        logs.get("health").warning("announcer checks off: admission is on but no Authorizer URL",
                                   hint="set admission.authorizer")
        return None, None
    adm = admission.enter(run, dht, "monitor")
    last: dict = {}

    def fetch() -> Optional[dict]:
        try:
            r = httpx.get(url + "/v1/nodes", headers={"Authorization": f"Bearer {adm.current()}"}, timeout=30)
            r.raise_for_status()
            last.clear()
            last.update({n["peer_id"]: n.get("stage") for n in r.json() if n.get("status") == "admitted"})
        except (httpx.HTTPError, ValueError) as e:
            logs.get("health").warning("Authorizer unreachable; using the last list of admitted nodes",
                                       error=f"{type(e).__name__}: {e}")
        return dict(last)

    return fetch, adm


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
    try:
        admitted, adm = admitted_source(run, dht)
    except BaseException:
        node.shutdown_dht(dht)
        engine.dispose()
        raise
    records, stages = RunRecords(dht, run.metadata.name), run.stage_names()
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
        if adm is not None:
            adm.stop.set()
        node.shutdown_dht(dht)
        engine.dispose()
    return done
