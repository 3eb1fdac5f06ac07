"""Emulated hosts for ``launch swarm`` (``local.hosts``): one Linux network namespace per node, its own
address, links shaped per node kind, role and stage (report §3.5.2.2). Root only.

Layout, for a launcher of pid P (every name starts with ``agx<P>``, so what a run left behind is found by
its prefix, and what a dead launcher left behind by :func:`sweep`):

- a hub namespace ``agx<P>-hub`` holding a bridge ``br0``;
- per node a namespace ``agx<P>-h<i>``: a veth pair, ``eth0`` inside (address ``.<i>`` of the run's /24)
  and ``agx<P>h<i>`` on the bridge; ``lo`` up;
- the launcher's own side: a veth ``agx<P>r`` in the root namespace with address ``.254`` (its DHT
  client watches the run from there), its peer on the bridge.

Shaping: bandwidth by ``tc tbf`` on both ends of a node's veth pair (``eth0``: upload; the bridge side:
download). Round-trip time by a delay line (:mod:`agoractl.runtime.delayline`) in the node's namespace
when any rule sets ``rtt_ms``: then every node listens on :data:`NODE_PORT` and announces
:data:`PUBLIC_PORT`, where its delay line relays. Without RTT the node listens and announces
:data:`PUBLIC_PORT` itself. Either way nothing listens on loopback.

:meth:`Hosts.close` removes every namespace, veth and delay line of the run, also after a failure; a
namespace's remaining processes are killed first.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.hosts import Hosts as HostsConfig, Shape
from agoractl.runtime.node import pid_alive

PREFIX = "agx"
PUBLIC_PORT = 31330
"""The port every node announces (its delay line's, or its own when there is none)."""
NODE_PORT = 31331
"""Where a node behind a delay line listens."""
LAUNCHER_HOST = 254
READY_TIMEOUT_S = 60.0
DELAY_LINE_NICE = -10


def check_available() -> None:
    """Root and the ``ip`` and ``tc`` tools, or a usage error saying what is missing."""
    if os.geteuid() != 0:
        raise UsageError("local.hosts.enabled needs root: network namespaces and veth pairs are created per node",
                         hint="run as root (or in a container with CAP_NET_ADMIN), or set local.hosts.enabled=false")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UsageError(f"local.hosts.enabled needs {' and '.join(missing)} (iproute2), not found on PATH",
                         hint="install iproute2 (apt-get install iproute2), or set local.hosts.enabled=false")


def run_ip(*args: str, ns: Optional[str] = None, tool: str = "ip", check: bool = True) -> str:
    argv = [tool, *(("-n", ns) if ns else ()), *args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise RuntimeFailure(f"`{' '.join(argv)}` failed: {r.stderr.strip() or r.returncode}",
                             hint="leftovers of this run are removed on exit; `ip netns list` shows what exists")
    return r.stdout


@dataclass
class Host:
    """One emulated host: a namespace, its address, its link, and the node's listen and announce addresses."""

    name: str
    ns: str
    address: str
    shape: Optional[Shape]
    delayed: bool
    delay_line: Optional[subprocess.Popen] = None

    @property
    def listen_maddr(self) -> str:
        return f"/ip4/{self.address}/tcp/{NODE_PORT if self.delayed else PUBLIC_PORT}"

    @property
    def announce_maddr(self) -> str:
        return f"/ip4/{self.address}/tcp/{PUBLIC_PORT}"

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def sets(self) -> list[str]:
        """The --set arguments that make a node listen on and announce this host's address."""
        return ["--set", f"network.host_maddrs=[{self.listen_maddr}]",
                "--set", f"network.announce_maddrs=[{self.announce_maddr}]"]


class Hosts:
    """The emulated hosts of one run; :meth:`open` builds the hub, :meth:`add` a host per node."""

    def __init__(self, config: HostsConfig, owner_pid: Optional[int] = None, log_dir: Optional[str] = None):
        self.config = config
        self.tag = f"{PREFIX}{owner_pid or os.getpid()}"
        self.hub = f"{self.tag}-hub"
        self.log_dir = log_dir
        self.hosts: list[Host] = []
        self.network: Optional[ipaddress.IPv4Network] = None
        self.delayed = any(s.rtt_ms > 0 for s in config.shaping)
        self.table_path = os.path.join(tempfile.gettempdir(), f"{self.tag}-rtt.json")

    # -- lifecycle ------------------------------------------------------------------------------

    def open(self) -> "Hosts":
        check_available()
        sweep()
        self.network = _free_subnet(ipaddress.ip_network(self.config.subnet))
        try:
            run_ip("netns", "add", self.hub)
            run_ip("link", "set", "lo", "up", ns=self.hub)
            run_ip("link", "add", "br0", "type", "bridge", ns=self.hub)
            run_ip("link", "set", "br0", "up", ns=self.hub)
            root = f"{self.tag}r"
            run_ip("link", "add", root, "type", "veth", "peer", "name", f"{self.tag}R", "netns", self.hub)
            run_ip("link", "set", f"{self.tag}R", "master", "br0", "up", ns=self.hub)
            run_ip("addr", "add", f"{self.launcher_address}/{self.network.prefixlen}", "dev", root)
            run_ip("link", "set", root, "up")
            self._write_table()
        except BaseException:
            self.close()
            raise
        return self

    @property
    def launcher_address(self) -> str:
        return str(self.network[LAUNCHER_HOST])

    def add(self, name: str, kind: str, role: Optional[str] = None, stage: Optional[str] = None) -> Host:
        """A new host for node `name`, shaped by the first matching rule, its delay line (if any) ready."""
        index = len(self.hosts) + 1
        if index >= LAUNCHER_HOST:
            raise RuntimeFailure(f"local.hosts: more than {LAUNCHER_HOST - 1} hosts in one run",
                                 hint="lower local.max_restarts or the number of nodes")
        ns, outer = f"{self.tag}-h{index}", f"{self.tag}h{index}"
        host = Host(name, ns, str(self.network[index]), self.config.shape_for(kind, role, stage), self.delayed)
        self.hosts.append(host)
        run_ip("netns", "add", ns)
        run_ip("link", "set", "lo", "up", ns=ns)
        run_ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        run_ip("link", "set", outer, "netns", self.hub)
        run_ip("link", "set", outer, "master", "br0", "up", ns=self.hub)
        run_ip("addr", "add", f"{host.address}/{self.network.prefixlen}", "dev", "eth0", ns=ns)
        run_ip("link", "set", "eth0", "up", ns=ns)
        if host.shape is not None and host.shape.bandwidth_mbps:
            shape_link(ns, "eth0", host.shape.bandwidth_mbps)  # upload
            shape_link(self.hub, outer, host.shape.bandwidth_mbps)  # download
        self._write_table()
        if self.delayed:
            host.delay_line = self._start_delay_line(host)
        return host

    def close(self) -> None:
        """Remove everything this run created: delay lines, namespaces (their processes killed), veths."""
        for host in self.hosts:
            if host.delay_line is not None and host.delay_line.poll() is None:
                _kill_group(host.delay_line.pid)
                try:
                    host.delay_line.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        remove(self.tag)
        try:
            os.unlink(self.table_path)
        except OSError:
            pass

    def launcher_run(self, run):
        """`run` as the launcher's own DHT node sees it: listening on its address on the hosts' bridge."""
        net = run.network.model_copy(update={"host_maddrs": [f"/ip4/{self.launcher_address}/tcp/0"],
                                             "announce_maddrs": []})
        return run.model_copy(update={"network": net})

    def describe(self) -> list[dict]:
        """Every host of the run: node, namespace, address, link (for status.json and the run report)."""
        return [{"node": h.name, "ns": h.ns, "address": h.address, "announce": h.announce_maddr,
                 "bandwidth_mbps": h.shape.bandwidth_mbps if h.shape else None,
                 "rtt_ms": h.shape.rtt_ms if h.shape else 0.0} for h in self.hosts]

    def __enter__(self) -> "Hosts":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _write_table(self) -> None:
        table = {h.address: (h.shape.rtt_ms if h.shape else 0.0) for h in self.hosts}
        tmp = f"{self.table_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(table, f)
        os.replace(tmp, self.table_path)

    def _start_delay_line(self, host: Host) -> subprocess.Popen:
        rtt = host.shape.rtt_ms if host.shape else 0.0
        # The delay line is the emulated network, not a node: on a loaded machine it runs at a higher priority
        # (nice -10) so that scheduling delays do not add to the RTT it emulates.
        argv = host.wrap(["nice", "-n", str(DELAY_LINE_NICE), sys.executable, "-m", "agoractl.runtime.delayline", "--listen",
                          f"{host.address}:{PUBLIC_PORT}", "--to", f"{host.address}:{NODE_PORT}",
                          "--rtt-ms", str(rtt), "--table", self.table_path])
        log = open(os.path.join(self.log_dir, f"delayline-{host.name}.log"), "ab") if self.log_dir else subprocess.DEVNULL
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        if log is not subprocess.DEVNULL:
            log.close()
        line = _read_line(proc, READY_TIMEOUT_S)
        if line.strip() != "ready":
            _kill_group(proc.pid)
            raise RuntimeFailure(f"the delay line of {host.name} ({host.ns}) did not start: exit code {proc.poll()}",
                                 hint=f"see {self.log_dir or 'its stderr'}")
        return proc


def shape_link(ns: str, dev: str, mbps: float) -> None:
    """tc tbf at `mbps` on `dev`'s egress in `ns`; the bucket holds at least 4 ms of traffic or 96 KiB (a GSO
    segment of the veth fits), the queue 50 ms."""
    rate_bytes = mbps * 1e6 / 8
    burst = int(max(96 * 1024, rate_bytes * 0.004))
    run_ip("qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbps}mbit", "burst", str(burst),
           "latency", "50ms", ns=ns, tool="tc")


def remove(tag: str) -> None:
    """Remove every namespace named ``<tag>-*`` (after killing the processes in it) and the veth ``<tag>r``."""
    for ns in namespaces(tag):
        for pid in run_ip("netns", "pids", ns, check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        for _ in range(50):  # `ip netns del` of a namespace whose processes are still dying can fail: retry
            if ns not in namespaces(tag):
                break
            run_ip("netns", "del", ns, check=False)
            time.sleep(0.1)
    run_ip("link", "del", f"{tag}r", check=False)


def namespaces(tag: str = PREFIX) -> list[str]:
    """Network namespaces whose names start with `tag` (every run's by default)."""
    names = [line.split()[0] for line in run_ip("netns", "list", check=False).splitlines() if line.strip()]
    return [n for n in names if n.startswith(tag)]


def sweep() -> list[str]:
    """Remove what launchers that no longer run left behind; returns their tags."""
    tags = {m.group(1) for n in namespaces() if (m := re.match(rf"^({PREFIX}(\d+))-", n))}
    tags |= {m.group(1) for m in re.finditer(rf"\d+: ({PREFIX}\d+)r[@:]", run_ip("-o", "link", check=False))}
    tables = {m.group(1) for n in os.listdir(tempfile.gettempdir()) if (m := re.match(rf"^({PREFIX}\d+)-rtt\.json$", n))}
    dead = sorted(t for t in tags | tables if not pid_alive(int(t[len(PREFIX):])))
    for tag in dead:
        remove(tag)
        try:  # the delay lines' RTT table (Hosts.table_path)
            os.unlink(os.path.join(tempfile.gettempdir(), f"{tag}-rtt.json"))
        except OSError:
            pass
    return dead


def _free_subnet(pool: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
    used = set()
    for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+)/", run_ip("-o", "-4", "addr", check=False)):
        used.add(ipaddress.ip_network(f"{m.group(1)}/24", strict=False))
    for net in pool.subnets(new_prefix=24):
        if net not in used:
            return net
    raise RuntimeFailure(f"local.hosts.subnet {pool}: every /24 in it is in use on this machine",
                         hint="choose another local.hosts.subnet")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if sel.select(timeout_s):
        return proc.stdout.readline().decode(errors="replace")
    return ""
