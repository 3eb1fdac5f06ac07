"""Unit tests of the worker's self-termination monitor (agoractl.training.self_termination)."""

import threading

from agoractl.manifest.workers import SelfTermination as Config
from agoractl.training.self_termination import Monitor, host_ram_fraction


def test_host_ram_fraction_is_a_fraction():
    assert 0.0 < host_ram_fraction() < 1.0


def test_monitor_fires_once_and_samples_ram():
    fired = []
    got = threading.Event()
    mon = Monitor(Config(max_ram_fraction=0.5), lambda t: (fired.append(t), got.set()), ram_period_s=0.01,
                  ram_fraction=lambda: 0.9)
    stop = threading.Event()
    mon.start(stop)
    assert got.wait(5)
    mon({"event": "gradients", "finite": False, "step": 1})
    stop.set()
    assert [t.rule for t in fired] == ["ram"]
