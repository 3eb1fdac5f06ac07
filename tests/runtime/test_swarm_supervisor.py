"""The swarm's supervision policy (agoractl.runtime.swarm_supervisor) in memory, without processes: the
restart budget and backoff, the stall clock and its one-line cause, and the supervisor's decisions on
stand-in nodes whose exit codes the test sets (hermetic: no network, no subprocess)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from agoractl.cli.main import exit_code
from agoractl.errors import StalledRun
from agoractl.manifest.schema import Run
from agoractl.runtime.swarm_supervisor import (RestartPolicy, StallClock, Supervisor, describe_exit,
                                               stall_cause)


def test_restart_budget_and_exponential_backoff():
    p = RestartPolicy(max_restarts=3, backoff_s=1.0, cap_s=3.0)
    delays = []
    for _ in range(4):
        delays.append(p.delay("worker-tail-0"))
        if delays[-1] is not None:
            p.record("worker-tail-0")
    assert delays == [1.0, 2.0, 3.0, None]  # doubled, capped, then spent
    assert p.delay("worker-head-0") == 1.0  # the budget is per node
    assert RestartPolicy(0, 1.0).delay("x") is None


def test_stall_clock_counts_from_the_last_step_or_restart():
    c = StallClock(timeout_s=10, now=0.0)
    c.observe(0, 1.0)
    assert not c.stalled(9.9) and c.stalled(10.0)
    c.observe(3, 12.0)  # a step: the clock starts again
    assert not c.stalled(21.0) and c.stalled(22.0)
    c.observe(3, 23.0)  # no new step: nothing changes
    assert c.stalled(23.0)
    c.reset(23.0)  # a restart gives the newcomer the full timeout
    assert not c.stalled(32.0)
    c.observe(4, 20.0)  # a step seen by a look that began before the restart: the restart's clock stands
    assert c.stalled(33.0)


def test_exits_and_causes_in_words():
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(81) == "self-termination rule nan_gradients (exit code 81)"
    assert describe_exit(86) == "preempted (exit code 86)"
    assert describe_exit(1) == "exit code 1"
    assert stall_cause({"head": 1, "tail": 0}, 1, last_exit={"tail": "worker-tail-0 killed"}) == \
        "stage tail has no live worker (worker-tail-0 killed)"
    assert stall_cause({"head": 1}, 0) == "no trainer is running"
    assert stall_cause({"head": 0}, 0, dht_error="TimeoutError").startswith("the DHT is unreachable")
    assert "yet no step completes" in stall_cause({"head": 1}, 1)


class FakeProc:
    def __init__(self, pid):
        self.pid = pid
        self.signals: list[int] = []

    def send_signal(self, sig):
        self.signals.append(sig)


class FakeNode:
    """A node whose exit code the test sets (None: running)."""

    def __init__(self, name, kind, stage=None, stats_path=None):
        self.name, self.kind, self.stage, self.stats_path = name, kind, stage, stats_path
        self.exit_code = None
        self.proc = FakeProc(0)

    def poll(self):
        return self.exit_code


class FakeSwarm:
    """What the supervisor uses of a Swarm: its run, nodes, snapshot, starting nodes, console notes."""

    def __init__(self, run: Run, tmp: Path):
        self.run, self.dir = run, tmp
        self.nodes = [FakeNode("dht", "dht")]
        for s in run.stage_names():
            self.nodes.append(FakeNode(f"worker-{s}-0", "worker", s))
        self.nodes.append(FakeNode("trainer-0", "trainer", stats_path=tmp / "trainer-0.json"))
        self.snapshot = SimpleNamespace(workers={}, error=None)
        self.notes: list[str] = []
        self.on_note = self.notes.append

    def start_worker(self, stage, name):
        n = FakeNode(name, "worker", stage)
        self.nodes.append(n)
        return n

    def start_trainer(self, index, name=None):
        n = FakeNode(name or f"trainer-{index}", "trainer")
        self.nodes.append(n)
        return n

    def steps(self, step):
        rec = SimpleNamespace(step=step, phase="active")
        self.snapshot.workers = {s: {f"peer-{s}": rec} for s in self.run.stage_names()}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def swarm(tmp_path):
    run = Run.model_validate({"local": {"max_restarts": 2, "restart_backoff_s": 1.0, "stall_timeout_s": 30}})
    return FakeSwarm(run, tmp_path)


def test_a_killed_worker_is_started_again_until_the_budget_is_spent_then_the_stall_ends_the_run(swarm):
    clock = Clock()
    sup = Supervisor(swarm, clock)
    sup.adopt()
    swarm.steps(5)
    sup.tick()
    for attempt, delay in ((1, 1.0), (2, 2.0)):
        victim = sup.slots["worker-tail-0"].current
        victim.exit_code = -signal.SIGKILL
        sup.tick()
        assert "starting it again" in swarm.notes[-1] and f"restart {attempt} of 2" in swarm.notes[-1]
        clock.t += delay - 0.1
        sup.tick()
        assert sup.slots["worker-tail-0"].current is victim  # still backing off
        clock.t += 0.2
        sup.tick()
        assert sup.slots["worker-tail-0"].current.name == f"worker-tail-0.r{attempt}"
        swarm.steps(5 + attempt)  # the newcomer serves: steps go on
        clock.t += 1
        sup.tick()
    assert sup.restarts() == {"worker-head-0": 0, "worker-body-1-0": 0, "worker-tail-0": 2, "trainer-0": 0}
    assert sup.stage_restarts("tail") == 2
    sup.slots["worker-tail-0"].current.exit_code = -signal.SIGKILL
    sup.tick()
    assert "not started again" in swarm.notes[-1]
    assert "stage tail has no live worker left: the run stalls, and ends 30 s after its last step" in swarm.notes[-1]
    clock.t += 29.0
    sup.tick()  # not yet: the stall timeout counts from the last step
    clock.t += 2.0
    with pytest.raises(StalledRun) as e:
        sup.tick()
    assert exit_code(e.value) == 3
    assert "stage tail has no live worker (worker-tail-0.r2 killed by SIGKILL" in e.value.message
    assert [x["restarted"] for x in sup.exits] == [True, True, False]


def test_finished_nodes_are_not_started_again(swarm):
    sup = Supervisor(swarm, Clock())
    sup.adopt()
    trainer = sup.slots["trainer-0"].current
    trainer.stats_path.write_text(json.dumps({"finished_reason": "data exhausted"}))
    trainer.exit_code = 0
    sup.tick()
    assert sup.settled(trainer) and sup.restarts()["trainer-0"] == 0
    assert sup.early_end == "trainer-0 ended early: data exhausted"
    assert "ended before training.max_steps: data exhausted" in swarm.notes[-1]
    # A trainer that failed is started again with the same ledger index.
    sup2 = Supervisor(FakeSwarm(swarm.run, swarm.dir), Clock())
    sup2.adopt()
    sup2.slots["trainer-0"].current.exit_code = 1
    sup2.tick()
    sup2.now.t = 5.0
    sup2.tick()
    assert sup2.slots["trainer-0"].current.name == "trainer-0.r1" and not sup2.settled(sup2.slots["trainer-0"].current)


def test_a_trainer_still_running_once_every_stage_finished_is_stopped_not_restarted(swarm):
    """A second trainer that never got a shard to read waits for workers forever; once every stage's workers
    finished their last step, it gets SIGTERM, and its exit ends the run as complete (no restart, no early end)."""
    swarm.nodes.append(FakeNode("trainer-1", "trainer", stats_path=swarm.dir / "trainer-1.json"))
    sup = Supervisor(swarm, Clock())
    sup.adopt()
    workers = [sup.slots[n].current for n in sup.slots if n.startswith("worker-")]
    for i, w in enumerate(workers):
        w.stats_path = swarm.dir / f"w{i}.json"
        w.stats_path.write_text(json.dumps({"step": swarm.run.training.stop_step}))
        w.exit_code = 0
        sup.tick()
        assert sup.slots["trainer-1"].current.proc.signals == ([signal.SIGTERM] if i == len(workers) - 1 else [])
    first = sup.slots["trainer-0"].current
    first.stats_path.write_text(json.dumps({"finished_reason": "max_steps reached"}))
    first.exit_code = 0
    late = sup.slots["trainer-1"].current
    late.exit_code = 128 + signal.SIGTERM
    sup.tick()
    assert sup.settled(late) and sup.settled(first) and sup.restarts()["trainer-1"] == 0 and sup.early_end is None
    assert "every stage reached its last step: stopping trainer-0, trainer-1" in swarm.notes[-1]
    assert sup.exits[-1]["how"].startswith("stopped once every stage reached its last step")


def test_a_stall_waits_for_a_pending_restart(swarm):
    clock = Clock()
    swarm.run.local.restart_backoff_s = 60.0
    sup = Supervisor(swarm, clock)
    sup.adopt()
    swarm.steps(1)
    sup.tick()
    sup.slots["worker-head-0"].current.exit_code = 85
    sup.tick()
    assert "self-termination rule device_error" in swarm.notes[-1]
    clock.t = 45.0
    sup.tick()  # stalled, but the restart is due at 60 s: say so, do not end
    assert swarm.notes[-1].startswith("stalled: no optimizer step for 45 s: stage head has no live worker")
    assert "waiting for the restart of worker-head-0" in swarm.notes[-1]


STOPPER = """
import os, signal, sys, time
from agoractl.runtime.swarm_supervisor import StopSignals

s = StopSignals(lambda: print("killed everything", flush=True), bound_s=1.0).install()
try:
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    s.stopping = True
    print("stopping", flush=True)
    os.kill(os.getpid(), signal.SIGINT)  # a second signal while stopping: only noted
    time.sleep(60)  # a stop that hangs: the bound ends it
"""


def test_a_signal_stops_once_and_the_bound_ends_a_hanging_stop(tmp_path):
    """In a child process: SIGTERM raises once, a second signal is only noted, and a stop that hangs is
    ended by the bound with every node killed and exit code 143 (the first signal's)."""
    import subprocess
    import sys
    import time

    p = subprocess.Popen([sys.executable, "-c", STOPPER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 143 and time.monotonic() - t0 < 10
    assert out.split() == ["stopping", "killed", "everything"]
    assert "SIGINT again: already stopping" in err and "did not stop within 1 s of SIGTERM" in err


def test_end_reason_names_exhausted_data_and_the_step():
    """`launch swarm`'s end_reason (exit 0 for the first two; the third is raised as a runtime failure)."""
    from agoractl.runtime.swarm import Swarm

    def fake(how, early=None):
        return SimpleNamespace(signals=SimpleNamespace(signum=None), run=SimpleNamespace(training=SimpleNamespace(
            max_steps=60, until_step=None)), supervisor=SimpleNamespace(early_end=early, exits=[
                {"kind": "worker", "how": "its stage reached training.max_steps"}, {"kind": "trainer", "how": how}]))

    exhausted = fake("data exhausted after 1 epoch(s)", "trainer-0 ended early: data exhausted after 1 epoch(s)")
    assert Swarm._end_reason(exhausted, {"completed": False, "steps": 14}, None) == \
        "data exhausted after 1 epoch(s) at step 14 of 60"
    assert Swarm._end_reason(fake("max_steps reached"), {"completed": True, "steps": 60}, None) == \
        "max_steps reached (step 60)"
    other = fake("interrupted by SIGTERM", "trainer-0 ended early: interrupted by SIGTERM")
    assert Swarm._end_reason(other, {"completed": False, "steps": 3}, None) == \
        "trainer-0 ended early: interrupted by SIGTERM"
