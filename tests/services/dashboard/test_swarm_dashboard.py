"""`launch swarm` with dashboard.enabled, short of a swarm (the live check is in
tests/services/health/test_monitoring_swarm.py, whose swarm starts the Dashboard): the manifest rule that it
needs the monitors, a taken dashboard.port refused in one line before anything starts, the URL it prints, and
the Dashboard started without --initial-peers (it never reads the DHT) while the Health Monitor gets them."""

from __future__ import annotations

import socket

import pytest

from agoractl.errors import AgoraError
from agoractl.manifest.loader import load_manifest
from agoractl.runtime.node import utility_args
from agoractl.services.dashboard import swarm
from tests.conftest import MANIFESTS

MANIFEST = MANIFESTS / "local-cpu.yaml"


def test_dashboard_needs_the_monitors():
    with pytest.raises(AgoraError, match="dashboard.enabled: needs monitoring.enabled"):
        load_manifest(MANIFEST, ["dashboard.enabled=true"])
    run = load_manifest(MANIFEST, ["dashboard.enabled=true", "monitoring.enabled=true", "dashboard.port=8491",
                                   "dashboard.host=0.0.0.0"])
    assert swarm.url(run) == "http://127.0.0.1:8491/"
    assert swarm.for_swarm(run, ["a=1"], "http://127.0.0.1:9", print) == ["a=1",
                                                                          "dashboard.prometheus_url=http://127.0.0.1:9"]


def test_only_the_monitor_joins_the_dht():
    peers = ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX"]
    assert utility_args("health", peers) == peers and utility_args("dashboard", peers) == []


def test_a_taken_port_is_refused_before_anything_starts(cli, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = cli("launch", "swarm", MANIFEST, "--set", "monitoring.enabled=true", "--set", "dashboard.enabled=true",
                   "--set", f"dashboard.port={port}", "--set", f"local.run_dir={tmp_path / 'run'}",
                   "--set", f"checkpoints.store={tmp_path / 'store'}", check=1)
    assert proc.stderr.splitlines()[0] == f"error: dashboard.port {port} on 127.0.0.1 is in use", proc.stderr
    assert not (tmp_path / "run" / "monitoring").exists()  # no Prometheus was started
