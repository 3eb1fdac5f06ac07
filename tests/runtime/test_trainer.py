"""A trainer (agoractl.runtime.trainer) that cannot reach a stage: in-process, against a real hivemind DHT
on loopback with no worker in it, it says which stage and ends with StalledRun (exit code 3) once
trainers.stall_timeout_s passed without a completed sample."""

from __future__ import annotations

import re
import signal
import time

import pytest
import torch

from agoractl.cli.main import exit_code
from agoractl.errors import StalledRun
from agoractl.manifest.schema import Run
from agoractl.runtime.trainer import Trainer


@pytest.fixture
def signals():
    """train() installs its own SIGINT/SIGTERM handlers: give pytest's back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_a_trainer_without_a_stage_to_reach_says_so_and_ends(signals, tmp_path):
    import hivemind

    seed = hivemind.DHT(start=True, startup_timeout=120)
    try:
        run = Run.model_validate({"trainers": {"stall_timeout_s": 3, "discovery_period_s": 1},
                                  "network": {"startup_timeout_s": 120}})
        samples = iter([torch.zeros(run.model.seq_len + 1, dtype=torch.long)] * 4)
        trainer = Trainer(run, 0, [str(a) for a in seed.get_visible_maddrs()], samples=samples,
                          stats_path=str(tmp_path / "trainer.json"))
        t0 = time.monotonic()
        with pytest.raises(StalledRun) as e:
            trainer.train()
        assert time.monotonic() - t0 < 3 + 10
        assert exit_code(e.value) == 3
        # the seconds it waited: the stall timeout (3 s), a second more when a loaded machine is slow to notice
        idle = re.search(r"no sample completed for (\d+) s: stage head has no reachable worker \(0 seen",
                         e.value.message)
        assert idle and 3 <= int(idle.group(1)) < 3 + 10, e.value.message
        assert "stage tail has no reachable worker" in e.value.message
        assert '"finished_reason": "stalled: no sample completed' in (tmp_path / "trainer.json").read_text()
    finally:
        seed.shutdown()


def test_an_empty_discovery_read_keeps_the_stages_workers(tmp_path):
    """A DHT read that comes back empty (under latency or load; the hosts swarm under churn with trainers at
    1000 ms RTT logged `live 0` for a stage for 2 s, twice, and lost samples on it) does not drop the stage's
    workers: every live worker has a record, so an empty read is a miss; calls that fail ban the dead ones."""
    import asyncio

    import hivemind

    from agoractl.runtime.records import WorkerRecord

    seed = hivemind.DHT(start=True, startup_timeout=120)
    trainer = None
    try:
        run = Run.model_validate({"network": {"startup_timeout_s": 120}})
        trainer = Trainer(run, 0, [str(a) for a in seed.get_visible_maddrs()], samples=iter([]),
                          stats_path=str(tmp_path / "trainer.json"))
        trainer.records.announce_worker(WorkerRecord(peer="worker-a", stage="head", step=3), ttl_s=2)
        asyncio.run(trainer.discover("head"))
        assert list(trainer.balancers["head"].workers) == ["worker-a"] and trainer.seen_step["head"] == 3
        time.sleep(2.5)  # the record expired: the next read finds nothing
        assert trainer.records.stage_workers("head") == {}
        asyncio.run(trainer.discover("head"))
        assert list(trainer.balancers["head"].workers) == ["worker-a"]
    finally:
        if trainer is not None:
            trainer.dht.shutdown()
        seed.shutdown()
