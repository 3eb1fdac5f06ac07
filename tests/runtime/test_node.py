"""Tests for agoractl.runtime.node's process accounting: a node's CPU seconds by component."""

import subprocess
import sys
import time

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
