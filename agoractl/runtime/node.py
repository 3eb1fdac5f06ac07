"""Process plumbing shared by every node (DHT seed, worker, trainer): the DHT, stop signals, the
parent watchdog, final stats.

- :func:`start_dht` starts a hivemind DHT node from ``network.*`` (loopback by default) with the
  manifest's generous p2pd start-up timeout and its daemon's Go settings (:func:`p2pd_environment`),
  starts it again when no initial peer answered (a busy seed), and turns failures into one-line errors.
- :func:`stop_on_signals`: SIGTERM and SIGINT set a stop event instead of killing the process, so a
  node finishes its current work, withdraws from the DHT and writes its stats.
- :func:`watch_parent`: a node started by ``launch swarm`` gets ``AGORA_PARENT_PID``; if that process
  disappears (even by SIGKILL, which runs no clean-up), the node stops itself rather than linger.
- :func:`write_stats`: the node's final statistics as JSON, written atomically (temp name + rename).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

from agoractl import logs, storage
from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.schema import Run
from agoractl.runtime.records import DHT_REPLICAS

PARENT_ENV = "AGORA_PARENT_PID"


BOOTSTRAP_ATTEMPTS = 4
"""Starts of the DHT node when p2pd could not reach any initial peer, 0.5, 1 and 2 s apart (within
``network.startup_timeout_s``): on a saturated machine a dial to a busy seed can fail for a few
seconds, and a later one gets through (a peer that is really gone fails every attempt, about 5 s
later than it would fail at once)."""
UNREACHED = ("failed to connect to bootstrap peers", "none of the initial_peers responded to a ping")
"""hivemind's errors when no initial peer answered: p2pd could not dial any, or the DHT's ping got no reply."""


def start_dht(run: Run, initial_peers: Sequence[str] = (), client_mode: bool = False):
    """A running ``hivemind.DHT`` joined to `initial_peers` (none: a new DHT, i.e. a seed)."""
    import hivemind

    from agoractl.runtime import admission

    deadline = time.monotonic() + run.network.startup_timeout_s
    for attempt in range(1, BOOTSTRAP_ATTEMPTS + 1):
        try:
            with p2pd_environment(run):  # the DHT process starts the daemon before the constructor returns
                dht = hivemind.DHT(
                    initial_peers=list(initial_peers) or None, start=True, client_mode=client_mode,
                    host_maddrs=list(run.network.host_maddrs),
                    announce_maddrs=list(run.network.announce_maddrs) or None,
                    startup_timeout=run.network.startup_timeout_s, await_ready=True,
                    # The run's records are short-lived and always read fresh (latest=True): re-fetching cached
                    # values before they expire, and pushing found values onto other nodes, only doubles traffic.
                    cache_refresh_before_expiry=0, cache_nearest=0, num_replicas=DHT_REPLICAS,
                )
        except Exception as e:  # p2pd start-up, a bad multiaddr, or no initial peer reachable
            unreached = initial_peers and any(m in str(e) for m in UNREACHED)
            pause = 0.5 * 2.0 ** (attempt - 1)
            if unreached and attempt < BOOTSTRAP_ATTEMPTS and time.monotonic() + pause < deadline:
                logs.get("node").warning("no initial peer answered; starting the DHT node again",
                                         attempt=attempt, retry_in_s=pause, initial_peers=list(initial_peers))
                time.sleep(pause)
                continue
            where = f"joining {', '.join(initial_peers)}" if initial_peers else "starting a new DHT"
            raise RuntimeFailure(f"the DHT node failed {where}: {type(e).__name__}: {e}",
                                 hint="check --initial-peers (multiaddrs printed by `agoractl launch dht`) and "
                                      "network.host_maddrs; raise network.startup_timeout_s on a loaded "
                                      "machine") from None
        else:
            return admission.guard(run, dht)  # admission on: every record carries and needs a credential


@contextlib.contextmanager
def p2pd_environment(run: Run) -> Iterator[None]:
    """The Go runtime's settings for the p2pd daemon started within: ``network.p2pd_max_procs`` as GOMAXPROCS,
    ``network.p2pd_gc_percent`` as GOGC (hivemind gives the daemon a copy of ``os.environ``); a null setting
    leaves the environment's own value. The environment is restored after, so that other programs this process
    starts (a test's peers, say) do not inherit them."""
    saved: dict[str, Optional[str]] = {}
    for name, value in (("GOMAXPROCS", run.network.p2pd_max_procs), ("GOGC", run.network.p2pd_gc_percent)):
        if value is not None:
            saved[name] = os.environ.get(name)
            os.environ[name] = str(value)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def require_peers(initial_peers: Sequence[str], what: str) -> list[str]:
    """The initial peers a worker or trainer needs, or a usage error saying where they come from."""
    peers = [p for p in initial_peers if p]
    if not peers:
        raise UsageError(f"a {what} needs a DHT to join: no --initial-peers and network.initial_peers is empty",
                         hint="start one with `agoractl launch dht FILE` and pass the multiaddrs it prints "
                              "with --initial-peers")
    return peers


def visible_maddrs(dht) -> list[str]:
    return [str(a) for a in dht.get_visible_maddrs()]


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM / SIGINT set `stop`; a second signal exits at once. Signals are counted, not `stop`: a node
    that was already stopping on its own (its stage finished) still gets to write its stats when the
    launcher's one SIGTERM arrives."""
    received: list[int] = []

    def handler(signum, _frame):
        if received:
            os._exit(128 + signum)
        received.append(signum)
        stop.signum = signum  # type: ignore[attr-defined]  # the node's end names it ("interrupted by SIGTERM")
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def watch_parent(stop: threading.Event, grace_s: float = 20.0,
                 on_orphan: Optional[Callable[[], None]] = None) -> None:
    """If AGORA_PARENT_PID is set, stop when that process is gone; exit hard `grace_s` later."""
    raw = os.environ.get(PARENT_ENV)
    if not raw:
        return
    parent = int(raw)

    def alive() -> bool:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def loop():
        while not stop.is_set():
            if not alive():
                if on_orphan is not None:
                    on_orphan()
                stop.set()
                time.sleep(grace_s)
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=loop, name="parent-watchdog", daemon=True).start()


def write_stats(path: Optional[str], data: dict[str, Any]) -> None:
    """Write `data` as JSON at `path` (temp name + rename); nothing when no path was given."""
    if path:
        storage.write_bytes_atomic(path, (json.dumps(data, indent=2, default=str) + "\n").encode())


_CHILD_CPU: dict[tuple[int, float], tuple[str, float]] = {}
"""(pid, creation time) -> (component, CPU seconds last read) of every child :func:`cpu_seconds` has seen: a
child that exited keeps its last reading, so a component's count never falls between two calls."""


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this node's processes: the node itself, its hivemind
    DHT process and its p2pd daemon(s) — where a node's time goes, for profiles. Children that exited since
    an earlier call count with their last reading."""
    import psutil

    me = psutil.Process()
    out = {"node": _cpu(me), "dht": 0.0, "p2pd": 0.0}
    for child in me.children(recursive=True):
        try:
            _CHILD_CPU[(child.pid, child.create_time())] = (
                "p2pd" if child.name().startswith("p2pd") else "dht", _cpu(child))
        except psutil.Error:
            pass
    for kind, cpu in _CHILD_CPU.values():
        out[kind] += cpu
    return {k: round(v, 3) for k, v in out.items()}


def _cpu(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


P2PD_GRACE_S = 2.0
"""Seconds the DHT process's p2pd daemon gets to exit after the DHT process stopped."""


def shutdown_dht(dht) -> None:
    """Stop the DHT process and its p2pd daemon. On a loaded machine hivemind may stop the DHT process
    "the hard way" (SIGTERM after its grace period), which leaves p2pd running as an orphan that holds
    this process's stdout and stderr open: a caller reading them (``subprocess.run``) then waits until
    its timeout although the command has finished. So whatever the DHT process started is killed too."""
    import psutil

    try:
        started = psutil.Process(dht.pid).children(recursive=True) if dht.pid else []
    except psutil.Error:
        started = []
    try:
        dht.shutdown()
    except Exception:  # the DHT process may already be gone (parent killed, p2pd died)
        pass
    _, alive = psutil.wait_procs(started, timeout=P2PD_GRACE_S)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


NO_DHT_UTILITIES = frozenset({"dashboard"})
"""Utility nodes of ``launch swarm`` (``agoractl launch KIND``) that never read the DHT (the Dashboard reads the
Health Monitor's database and Prometheus): started without --initial-peers."""


def utility_args(kind: str, peer_args: list[str]) -> list[str]:
    """The extra arguments of the swarm's utility node KIND, given its ``--initial-peers`` arguments."""
    return [] if kind in NO_DHT_UTILITIES else list(peer_args)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
