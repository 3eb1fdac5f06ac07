"""``launch swarm`` keeps its nodes alive, ends a stalled run, and stops on a signal within its bound: real
swarms on loopback (DHT seed, 2 stages x 1 worker, 1 trainer, each its own process), not mocked, marked
``swarm``, in the smallest setting that still trains through the pipeline (2 stages, seq_len 32, batch 4).
Three swarms, as each ends a different way:

- The only tail worker is SIGKILLed twice: each time a new one joins (at the run's step, from the stage's
  newest checkpoint) and serves, the run reaches ``training.max_steps``, and the report counts two restarts
  for the tail stage.
- The only tail worker is SIGKILLed and the launcher gets SIGINT right after: it exits 130 within
  ``STOP_BOUND_S`` and nothing of any node is left.
- With ``local.max_restarts: 0`` the only tail worker is SIGKILLed: the console names the stalled stage
  and the launcher exits 3 within ``local.stall_timeout_s`` + 10 s, its report's ``end_reason`` naming it.

The policy itself (budget, backoff, the stall clock) is tested without processes in test_swarm_supervisor.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from agoractl.runtime.swarm_supervisor import STOP_BOUND_S
from tests.conftest import private_shards
from tests.runtime.test_swarm import (
    TINY,
    Procs,
    by_stage,
    err_tail,
    live_members,
    finish,
    run_swarm,
    wait_status,
)

pytestmark = pytest.mark.swarm
SMALL = TINY + ["stages=[{role: head, layers: 2}, {role: tail, layers: 2}]", "model.seq_len=32",
                "training.global_batch_size=4", "workers.max_microbatch=4",
                "local.workers_per_stage=1", "local.trainers=1", "trainers.count=1", "local.restart_backoff_s=0.5"]
STALL_S = 20
MAX_STEPS = 300


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


def ready(run_dir, node: str) -> bool:
    """Whether the node's log says it is ready (serving)."""
    log = run_dir / "swarm" / "logs" / f"{node}.log"
    return log.exists() and '"worker ready"' in log.read_text()


def swarm_err(run_dir) -> str:
    return (run_dir.parent / f"{run_dir.name}-swarm.err").read_text()


def test_killed_tail_worker_is_replaced_twice_and_the_run_reaches_max_steps(sample_shards, procs, tmp_path):
    run_dir = tmp_path / "run"
    p, status = run_swarm(procs, run_dir, private_shards(sample_shards, tmp_path) + SMALL + [
        f"training.max_steps={MAX_STEPS}", "local.max_restarts=2", "local.stall_timeout_s=120",
        "checkpoints.every_steps=10"])
    # Past the step-10 checkpoint, so each replacement has one in the store to rejoin from (killed sooner, a fast
    # start's replacements found none and started from init).
    s = wait_status(status, p, lambda s: s["stages"]["tail"]["step"] >= 15)
    for attempt in (1, 2):
        victim = current(s, "worker-tail-0")
        os.killpg(victim["pid"], signal.SIGKILL)  # the whole node: python, its DHT process and p2pd
        # A new one joins (a new process, started by the launcher) and serves: the tail steps past where the
        # newcomer said it was ready (the killed worker's record lingers in the DHT for its TTL meanwhile).
        s = wait_status(status, p, lambda s: s["restarts"]["worker-tail-0"] == attempt  # noqa: B023
                        and current(s, "worker-tail-0")["pid"] != victim["pid"]  # noqa: B023
                        and ready(run_dir, current(s, "worker-tail-0")["name"]), timeout=150)
        at = s["stages"]["tail"]["step"]
        s = wait_status(status, p, lambda s: s["stages"]["tail"]["step"] >= at + 1, timeout=60)  # noqa: B023
    r = finish(p, run_dir)  # exit 0
    assert r["completed"] and r["steps"] == MAX_STEPS and r["end_reason"] == f"max_steps reached (step {MAX_STEPS})"
    assert r["restarts"]["worker-tail-0"] == 2 and by_stage(r)["tail"]["restarts"] == 2
    assert r["restarts"]["worker-head-0"] == 0 and by_stage(r)["head"]["restarts"] == 0
    kills = [e for e in r["node_exits"] if e["slot"] == "worker-tail-0"]
    assert [(e["node"], e["how"], e["restarted"]) for e in kills] == [
        ("worker-tail-0", "killed by SIGKILL", True), ("worker-tail-0.r1", "killed by SIGKILL", True)]
    # Each replacement rejoined at the run's step, from the stage's newest checkpoint in the store.
    last = [w for w in r["workers"] if w["stage"] == "tail" and not w["killed"]]
    assert len(last) == 1 and last[0]["step"] == MAX_STEPS, r["workers"]
    join = last[0]["join"]
    # (action "join" when the killed worker's progress record had not expired yet: its step, same checkpoint)
    assert join["action"] in ("rejoin", "join") and join["source"] == "store" and join["loaded_step"] % 10 == 0, join
    assert join["loaded_step"] <= join["loaded_step"] + join["stale_steps"] < MAX_STEPS, join
    err = swarm_err(run_dir)
    assert "worker-tail-0 killed by SIGKILL; starting it again" in err
    assert "worker-tail-0.r1 killed by SIGKILL; starting it again" in err and "(restart 2 of 2)" in err


def test_sigint_while_a_worker_is_being_killed_stops_everything_in_bound(sample_shards, procs, tmp_path):
    run_dir = tmp_path / "run"
    p, status = run_swarm(procs, run_dir, private_shards(sample_shards, tmp_path) + SMALL + [
        "training.max_steps=100000", "local.max_restarts=2"])
    s = wait_status(status, p, lambda s: s["stages"]["tail"]["step"] >= 1)
    os.killpg(current(s, "worker-tail-0")["pid"], signal.SIGKILL)  # a worker is being killed ...
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)  # ... when Ctrl-C comes
    p.communicate(timeout=STOP_BOUND_S + 30)
    stopped_s = time.monotonic() - t0
    assert p.returncode == 130, err_tail(run_dir)
    groups = {p.pid} | {n["pid"] for n in json.loads(status.read_text())["nodes"]}
    assert not live_members(groups)  # nothing of any node: python, DHT process, p2pd
    assert stopped_s <= STOP_BOUND_S + 5, stopped_s  # + the test's own latency on a loaded machine
    r = json.loads((run_dir / "swarm-report.json").read_text())
    assert r["end_reason"] == "interrupted by SIGINT" and r["interrupted"] and not r["completed"]


def test_without_restarts_a_killed_tail_worker_ends_the_run_as_stalled_in_bound(sample_shards, procs, tmp_path):
    run_dir = tmp_path / "run"
    p, status = run_swarm(procs, run_dir, private_shards(sample_shards, tmp_path) + SMALL + [
        "training.max_steps=100000", "local.max_restarts=0", f"local.stall_timeout_s={STALL_S}"])
    s = wait_status(status, p, lambda s: s["step"] >= 1)
    os.killpg(current(s, "worker-tail-0")["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    try:
        p.communicate(timeout=STALL_S + 40)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the stalled swarm did not end; stderr:\n{err_tail(run_dir)}")
    ended_s = time.monotonic() - t0
    assert p.returncode == 3, err_tail(run_dir)
    assert ended_s <= STALL_S + 10, ended_s
    err = swarm_err(run_dir)
    assert "stage tail has no live worker left: the run stalls" in err  # said at the kill
    assert "stalled: no optimizer step for" in err and "stage tail has no live worker" in err
    r = json.loads((run_dir / "swarm-report.json").read_text())
    assert r["end_reason"].startswith("stalled: no optimizer step") and "stage tail has no live worker" in r["end_reason"]
    assert "local.max_restarts=0" in r["end_reason"] and not r["completed"]
    assert r["restarts"]["worker-tail-0"] == 0
    groups = {p.pid} | {n["pid"] for n in json.loads(status.read_text())["nodes"]}
    assert not live_members(groups)
