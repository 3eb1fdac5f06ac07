"""Churn of a local swarm (report §3.7: workers come and go): ``agoractl ops churn`` and the launcher's side.

``ops churn FILE --every S --for S`` picks a random live worker of the swarm that ``launch swarm`` runs
(from ``<run_dir>/swarm/status.json``) on a schedule and writes a request file into
``<run_dir>/swarm/requests/``; the launcher (:func:`serve_requests`, every look at its nodes) kills that
worker's process group with SIGKILL and starts a new worker for the same stage through the ordinary
``launch worker`` path: the newcomer joins as any does (state from peers or the store, the sync phases,
and the Authorizer when admission is on), on a new emulated host when ``local.hosts`` is on. The
launcher answers with a ``.done`` file, notes the event, and marks it joined once the newcomer's DHT
record serves. Replacements do not spend ``local.max_restarts``. Every event is in the run report
(``churn``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Optional

from agoractl import storage
from agoractl.runtime.node import pid_alive
from agoractl.runtime.records import SERVING_PHASES

REQUESTS = "requests"


def worker_role(name: str, workers_per_stage: int, contributors_per_stage: int) -> str:
    """The role of the swarm's worker `name` (``worker-<stage>-<i>[.r<n>]``): the last
    `contributors_per_stage` of each stage's workers are contributors, the rest operators."""
    try:
        index = int(name.split(".r", 1)[0].rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return "operator"
    return "contributor" if index >= workers_per_stage - contributors_per_stage else "operator"


async def connected_maddrs(_dht, node) -> list[str]:
    """In the DHT process: the multiaddrs of every peer its p2p daemon is connected to."""
    infos = await node.p2p.list_peers()
    return sorted({str(a) for info in infos for a in info.addrs})


# -- the launcher's side ------------------------------------------------------------------------


def observe_peers(swarm) -> None:
    """Add the multiaddrs of every peer the launcher's DHT node is connected to (on emulated hosts)."""
    try:
        swarm.peer_maddrs.update(swarm.dht.run_coroutine(connected_maddrs))
    except Exception:  # a busy DHT process: the next look gets them
        pass


def serve_requests(swarm) -> None:
    """Carry out pending churn requests of `swarm` (a :class:`~agoractl.runtime.swarm.Swarm`), and note joins."""
    folder = swarm.dir / REQUESTS
    log = swarm.__dict__.setdefault("churn_events", [])
    for event in log:
        if event.get("joined_s") is None and event.get("new_pid"):
            rec = next((r for r in swarm.seen.values() if r.pid == event["new_pid"] and r.phase in SERVING_PHASES), None)
            if rec is not None:
                event["joined_s"] = round(time.time() - event["time"], 1)
                event["new_peer"] = rec.peer
                swarm.on_note(f"churn: {event['started']} joined stage {event['stage']} "
                              f"{event['joined_s']:.0f} s after {event['killed']} was killed")
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.json")):
        if path.name.endswith(".done.json") or (folder / f"{path.stem}.done.json").exists():
            continue
        try:
            request = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # half-written requests are renamed into place: this one is not ours
        answer = replace_worker(swarm, request.get("node"))
        answer["id"] = request.get("id", path.stem)
        if "killed" in answer:
            log.append(answer)
        storage.write_bytes_atomic(str(folder / f"{path.stem}.done.json"), (json.dumps(answer) + "\n").encode())


def replace_worker(swarm, name: Optional[str]) -> dict:
    """SIGKILL the live worker `name` (its whole process group) and start a new one for its stage."""
    sup = swarm.supervisor
    slot = next((s for s in sup.slots.values() if s.kind == "worker" and s.current.name == name), None)
    if slot is None or slot.settled or slot.due is not None or slot.current.poll() is not None:
        return {"error": f"{name} is not a live worker of this swarm"}
    old = slot.current
    try:
        os.killpg(old.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        old.proc.wait(10)
    except Exception:
        pass
    old.poll()
    replaced = sum(".rc" in n.name for n in slot.nodes)
    new = swarm.start_worker(slot.stage, f"{slot.name}.rc{replaced + 1}")
    slot.nodes.append(new)  # the supervisor watches the newcomer; the killed node's exit is churn, not a failure
    sup.stall.reset(sup.now())
    event = {"time": time.time(), "stage": slot.stage, "killed": old.name, "pid": old.proc.pid,
             "exit_code": old.exit_code, "started": new.name, "new_pid": new.proc.pid, "joined_s": None}
    swarm.on_note(f"churn: killed {old.name} (pid {old.proc.pid}, SIGKILL); started {new.name} (pid {new.proc.pid})")
    return event


def events(swarm) -> list[dict]:
    return list(swarm.__dict__.get("churn_events", []))


# -- the client's side (ops churn) ---------------------------------------------------------------


def node_status(nodes, snap) -> list[dict]:
    """The launcher's nodes as ``status.json`` lists them; a worker's ``serving``: whether its DHT record (in the
    launcher's last look, `snap`) says it serves, i.e. it has joined (a newcomer in weight sync does not)."""
    serving = {r.pid for recs in snap.workers.values() for r in recs.values() if r.phase in SERVING_PHASES}
    return [{"name": n.name, "kind": n.kind, "stage": n.stage, "pid": n.proc.pid, "exit_code": n.poll(),
             **({"serving": n.proc.pid in serving} if n.kind == "worker" else {})} for n in nodes]


def live_workers(status: dict) -> list[dict]:
    return [n for n in status.get("nodes", []) if n.get("kind") == "worker" and n.get("exit_code") is None]


def wait_training(status_file: Path, timeout_s: float) -> bool:
    """Whether the swarm whose status file this is reached its first step within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if int(json.loads(Path(status_file).read_text()).get("step", 0)) >= 1:
                return True
        except (OSError, ValueError, TypeError):
            pass
        time.sleep(0.5)
    return False


def launcher_alive(status: dict) -> bool:
    """Whether the launcher that wrote this status is still running (a status without its pid: assumed so)."""
    pid = status.get("launcher_pid")
    return not isinstance(pid, int) or pid_alive(pid)


def read_status(status_file: Path) -> dict:
    try:
        return json.loads(Path(status_file).read_text())
    except (OSError, ValueError):
        return {}


def request(run_dir: Path, node: str, timeout_s: float, status_file: Optional[Path] = None) -> Optional[dict]:
    """Ask the launcher to replace `node`; its answer, or None if none came within `timeout_s` (or, given the
    swarm's `status_file`, as soon as its launcher is gone)."""
    folder = Path(run_dir) / "swarm" / REQUESTS
    folder.mkdir(parents=True, exist_ok=True)
    rid = f"{time.time_ns()}-{os.getpid()}"
    storage.write_bytes_atomic(str(folder / f"{rid}.json"), json.dumps({"id": rid, "node": node}).encode())
    done = folder / f"{rid}.done.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads(done.read_text())
        except (OSError, ValueError):
            if status_file is not None and not launcher_alive(read_status(status_file)):
                return None
            time.sleep(0.2)
    return None


def schedule(every_s: float, for_s: float, count: Optional[int]) -> list[float]:
    """Offsets (s from the start) of the replacements: every `every_s` within `for_s`, at most `count`."""
    out, t = [], every_s
    while t <= for_s + 1e-9 and (count is None or len(out) < count):
        out.append(round(t, 3))
        t += every_s
    return out


def pick(workers: list[dict], rng: random.Random) -> Optional[dict]:
    """A random serving worker of a stage where another one serves too: never the last serving worker of its
    stage, and never a newcomer still joining (killing one would leave its stage without a joined worker, or
    a join never completed). A status without ``serving`` (an older launcher) counts every live worker."""
    per_stage: dict = {}
    for w in workers:
        if w.get("serving", True):
            per_stage.setdefault(w.get("stage"), []).append(w)
    eligible = [w for ws in per_stage.values() if len(ws) > 1 for w in ws]
    return rng.choice(eligible) if eligible else None
