"""Tests for agoractl.runtime.node: a node's CPU seconds by component, and the Go settings of its p2pd daemon."""

import os
import subprocess
import sys
import time

import psutil
import pytest

from agoractl.manifest.schema import Run
from agoractl.runtime import node


def test_a_child_that_exited_keeps_its_cpu_seconds():
    """A child's CPU counts after it exits: a profile's difference of two readings is never negative."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        deadline = time.monotonic() + 30
        before = node.cpu_seconds()
        while before["dht"] < 0.3 and time.monotonic() < deadline:  # the child spends its 0.4 s, then sleeps
            time.sleep(0.1)
            before = node.cpu_seconds()
        assert before["dht"] >= 0.3, before
    finally:
        child.kill()
        child.wait()
    after = node.cpu_seconds()
    assert after["dht"] >= before["dht"], (before, after)
    assert after["node"] >= before["node"]


def test_p2pd_runs_with_the_manifests_go_settings(monkeypatch):
    """The daemon a DHT node starts gets network.p2pd_max_procs as GOMAXPROCS and p2pd_gc_percent as GOGC,
    whatever the environment said; the process's own environment is left as it was."""
    monkeypatch.setenv("GOMAXPROCS", "7")
    monkeypatch.delenv("GOGC", raising=False)
    dht = node.start_dht(Run(network={"p2pd_max_procs": 1, "p2pd_gc_percent": 250}))
    try:
        daemons = [p for p in psutil.Process(dht.pid).children(recursive=True) if p.name().startswith("p2pd")]
        assert len(daemons) == 1, daemons
        env = daemons[0].environ()
        assert (env.get("GOMAXPROCS"), env.get("GOGC")) == ("1", "250")
    finally:
        node.shutdown_dht(dht)
    assert os.environ["GOMAXPROCS"] == "7" and "GOGC" not in os.environ


def test_a_null_go_setting_leaves_the_environments_value(monkeypatch):
    monkeypatch.setenv("GOMAXPROCS", "3")
    monkeypatch.delenv("GOGC", raising=False)
    with node.p2pd_environment(Run(network={"p2pd_max_procs": None, "p2pd_gc_percent": None})):
        assert os.environ["GOMAXPROCS"] == "3" and "GOGC" not in os.environ
    with node.p2pd_environment(Run(network={"p2pd_gc_percent": 400})):
        assert (os.environ["GOMAXPROCS"], os.environ["GOGC"]) == ("3", "400")
    assert os.environ["GOMAXPROCS"] == "3" and "GOGC" not in os.environ


def test_go_settings_must_be_positive():
    with pytest.raises(ValueError, match="p2pd_max_procs"):
        Run(network={"p2pd_max_procs": 0})
