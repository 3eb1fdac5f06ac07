"""``launch swarm`` keeps its nodes alive and stops on a signal within its bound: a real swarm on loopback
(DHT seed, one worker per stage, one trainer, each its own process), not mocked, marked ``swarm``.

One swarm serves every check, in order: its only tail worker is SIGKILLed twice and each time a new one
joins and serves (steps go on past the kill); killed a third time, with ``local.max_restarts`` spent, the
console says the run stalls; then, while a head worker is being stopped, the launcher gets SIGINT: it
exits 130 within ``STOP_BOUND_S`` and nothing of any node is left. The policy itself (budget, backoff,
the stall that ends a run with exit code 3) is tested without processes in test_swarm_supervisor.py.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from agoractl.runtime.swarm_supervisor import STOP_BOUND_S
from tests.conftest import private_shards
from tests.runtime.test_swarm import TINY, Procs, by_stage, err_tail, live_members, run_swarm, wait_status

pytestmark = pytest.mark.swarm


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.kill_all()


def current(status: dict, slot: str) -> dict:
    """The running incarnation of a supervised node (worker-tail-0, then worker-tail-0.r1, ...)."""
    live = [n for n in status["nodes"] if n["name"].split(".r")[0] == slot and n["exit_code"] is None]
    assert live, status["nodes"]
    return live[-1]


def test_killed_tail_worker_is_replaced_twice_and_sigint_stops_everything_in_bound(sample_shards, procs, tmp_path):
    run_dir = tmp_path / "run"
    values = private_shards(sample_shards, tmp_path) + TINY + [
        "local.workers_per_stage=1", "local.trainers=1", "trainers.count=1", "training.max_steps=100000",
        "local.max_restarts=2", "local.restart_backoff_s=0.5", "local.stall_timeout_s=120",
        f"checkpoints.store={tmp_path / 'store'}"]
    p, status = run_swarm(procs, run_dir, values)
    s = wait_status(status, p, lambda s: s["step"] >= 2)
    for attempt in (1, 2):
        victim = current(s, "worker-tail-0")
        at = s["stages"]["tail"]["step"]
        os.killpg(victim["pid"], signal.SIGKILL)  # the whole node: python, its DHT process and p2pd
        # A new one joins (a new process, started by the launcher) and serves: the tail steps past the kill.
        s = wait_status(status, p, lambda s: s["restarts"]["worker-tail-0"] == attempt
                        and current(s, "worker-tail-0")["pid"] != victim["pid"]
                        and s["stages"]["tail"]["step"] >= at + 2, timeout=150)
    # Third time: the budget is spent, and the console says what that means for the run.
    os.killpg(current(s, "worker-tail-0")["pid"], signal.SIGKILL)
    wait_status(status, p, lambda s: "no live worker left: the run stalls" in err_tail(run_dir), timeout=60)
    head = current(s, "worker-head-0")
    os.killpg(head["pid"], signal.SIGTERM)  # the head worker is stopping ...
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)  # ... when Ctrl-C comes
    p.communicate(timeout=STOP_BOUND_S + 30)
    stopped_s = time.monotonic() - t0
    assert p.returncode == 130, err_tail(run_dir)
    groups = {p.pid} | {n["pid"] for n in json.loads(status.read_text())["nodes"]}
    assert not live_members(groups)  # nothing of any node: python, DHT process, p2pd
    assert stopped_s <= STOP_BOUND_S + 5, stopped_s  # + the test's own latency on a loaded machine
    r = json.loads((run_dir / "swarm-report.json").read_text())
    assert r["end_reason"] == "interrupted by SIGINT" and r["interrupted"]
    assert r["restarts"]["worker-tail-0"] == 2 and by_stage(r)["tail"]["restarts"] == 2
    assert by_stage(r)["head"]["restarts"] == 0
    kills = [e for e in r["node_exits"] if e["slot"] == "worker-tail-0"]
    assert [(e["how"], e["restarted"]) for e in kills] == [("killed by SIGKILL", True)] * 2 + [("killed by SIGKILL", False)]
    assert r["exit_codes"]["worker-tail-0"] == r["exit_codes"]["worker-tail-0.r1"] == -signal.SIGKILL
    err = (run_dir.parent / f"{run_dir.name}-swarm.err").read_text()
    assert "worker-tail-0 killed by SIGKILL; starting it again" in err
    assert "worker-tail-0.r1 killed by SIGKILL; starting it again" in err and "(restart 2 of 2)" in err
