"""Emulated hosts (agoractl.runtime.hosts, delayline, linkprobe) with real namespaces, veths and tc — no swarm.

Needs root and iproute2 (skipped otherwise, with the reason). Two hosts on the bridge: a contributor shaped
to 100 Mbit/s and 100 ms RTT, an unshaped worker; the link probe runs between them over the path the
nodes use (tbf on the veths, the delay line in front of the server). Throughput must be within ±10% of
the configured bandwidth, and the RTT the link adds within ±5 ms of the configured RTT: the median RTT of the
shaped path minus that of the same path from an unshaped third host (what this loaded machine's scheduling
adds on its own: a few ms at load 20-40; measured once more if a burst of load spoils the first). Both ends of the probe run at the delay line's priority (nice -10). Every namespace, veth and
process is removed, also when an assertion fails (``ip netns list`` before and after). Also: a launch
as an unprivileged user fails with one error line and a hint, exit 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from agoractl.manifest.hosts import Hosts as HostsConfig, Shape
from agoractl.runtime import hosts as H
from tests.conftest import MANIFESTS

root_only = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                               reason="needs root and iproute2 (ip, tc) for network namespaces")


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


@root_only
@pytest.mark.xdist_group("swarm")  # never beside the namespaces swarm: its hosts would be in `before`, its load in the RTT
def test_shaped_link_has_the_configured_bandwidth_and_rtt():
    before = H.namespaces()
    config = HostsConfig(enabled=True, shaping=[Shape(kind="worker", role="contributor", bandwidth_mbps=100,
                                                      rtt_ms=100)])
    hosts = H.Hosts(config)
    server = None
    try:
        hosts.open()
        contributor = hosts.add("contributor", "worker", "contributor", "head")
        worker = hosts.add("worker", "worker", "operator", "head")
        other = hosts.add("other", "worker", "operator", "tail")  # unshaped: the baseline of the same path
        assert len(H.namespaces(hosts.tag)) == 4  # the hub and three hosts
        tc = subprocess.run(["tc", "-n", contributor.ns, "qdisc", "show", "dev", "eth0"], capture_output=True,
                            text=True).stdout
        assert "tbf" in tc and "100Mbit" in tc
        # Both ends of the probe run at the delay line's priority: what is measured is the link, not how long
        # this loaded machine's run queue keeps a woken process waiting.
        nice = ["nice", "-n", str(H.DELAY_LINE_NICE)]
        server = subprocess.Popen(worker.wrap([*nice, sys.executable, "-m", "agoractl.runtime.linkprobe", "serve",
                                               f"{worker.address}:{H.NODE_PORT}"]),
                                  stdout=subprocess.PIPE, start_new_session=True)
        assert H._read_line(server, 120).strip() == "ready"

        def probe(host, seconds: float) -> dict:
            out = subprocess.run(host.wrap([*nice, sys.executable, "-m", "agoractl.runtime.linkprobe", "probe",
                                            f"{worker.address}:{H.PUBLIC_PORT}", "--pings", "40",
                                            "--seconds", str(seconds), "--mbps-hint", "100"]),
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            return json.loads(out.stdout)

        for attempt in range(2):  # one more measurement when a burst of load on this shared machine hit the first
            baseline = probe(other, 0.5)  # the same path with no delay: what this machine adds on its own
            measured = probe(contributor, 4.0)
            added = measured["rtt_ms"] - baseline["rtt_ms"]
            print(f"attempt {attempt + 1}: shaped {measured}; unshaped baseline {baseline}; added RTT {added:.1f} ms")
            if 95.0 <= added <= 105.0:
                break
        assert 90.0 <= measured["throughput_mbps"] <= 110.0, measured
        assert 95.0 <= added <= 105.0, (measured, baseline)
    finally:
        if server is not None:
            H._kill_group(server.pid)
            server.wait(10)
        hosts.close()
    assert H.namespaces(hosts.tag) == [] and H.namespaces() == before
    assert f"{hosts.tag}r" not in _links() and f"{hosts.tag}h" not in _links()


@root_only
def test_sweep_removes_what_a_dead_launcher_left():
    dead = subprocess.Popen(["true"])
    dead.wait()
    hosts = H.Hosts(HostsConfig(enabled=True), owner_pid=dead.pid)
    hosts.open()
    hosts.add("node", "worker")
    assert len(H.namespaces(hosts.tag)) == 2
    assert hosts.tag in H.sweep()  # what a SIGKILLed launcher leaves behind goes at the next start
    assert H.namespaces(hosts.tag) == [] and f"{hosts.tag}r" not in _links()
    assert not os.path.exists(hosts.table_path)  # its delay lines' RTT table too


@root_only
def test_unprivileged_launch_is_a_usage_error(tmp_path):
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to drop root")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "HOME": str(tmp_path)}
    tmp_path.chmod(0o777)
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "agoractl",
                        "launch", "swarm", str(MANIFESTS / "local-cpu.yaml"), "--set", "local.hosts.enabled=true",
                        "--set", f"local.run_dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env,
                       cwd=os.getcwd(), timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("error: local.hosts.enabled needs root") and lines[1].startswith("hint:")
    assert "Traceback" not in r.stderr
