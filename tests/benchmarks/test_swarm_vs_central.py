"""benchmarks/swarm_vs_central.py's CPU accounting: GroupCPU reads from /proc the CPU of a launched process and
of the children that lead their own process groups (as the swarm's nodes do), children of those included.
Real processes burning real CPU; no swarm."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.benchmarks import load_benchmark
from tests.conftest import ROOT

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
LAUNCHER = f"""
import subprocess, sys
node = subprocess.Popen([sys.executable, "-c", {BURN.format(s=1.0)!r}], start_new_session=True)
{BURN.format(s=0.3)}
node.wait()
"""


def test_group_cpu_counts_the_children_leading_their_own_groups():
    bench = load_benchmark("swarm_vs_central")
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], start_new_session=True)
    cpu = bench.GroupCPU(proc.pid, period=0.05)
    proc.wait(timeout=60)
    time.sleep(0.1)
    cpu.stop()
    total = cpu.between(start - 1, time.time() + 1)
    # 1.0 s in the node, 0.3 s in the launcher (its own children's time is not in its /proc stat until
    # reaped, so the node's must have come from reading the node); less what the last poll missed.
    assert 1.1 < total < 2.5, total
