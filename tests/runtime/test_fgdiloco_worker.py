"""FGDiLoCo in a real swarm (agoractl.runtime.fgdiloco_worker): ``launch swarm`` of
``manifests/fgdiloco-local-cpu.yaml``, 2 stages x 2 workers: outer rounds complete over hivemind and
the loss falls. The outer rounds' maths in one process: tests/training/test_fgdiloco_rounds.py.
"""

from __future__ import annotations

import pytest

from tests.conftest import MANIFESTS
from tests.runtime.test_swarm import by_stage, corpus, finish, procs, run_swarm, sets  # noqa: F401


@pytest.mark.swarm
def test_fgdiloco_swarm_trains(corpus, procs, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    values = corpus + [
        "model.seq_len=64", "training.max_steps=16", "training.schedule.warmup_steps=2",
        "data_parallel.fgdiloco.inner_steps=4", "workers.announce_period_s=1", "trainers.discovery_period_s=2",
        "trainers.request_timeout_s=30", "network.startup_timeout_s=90", "data_parallel.fgdiloco.matchmaking_timeout_s=10",
        f"local.run_dir={run_dir}", f"checkpoints.store={tmp_path / 'store'}"]
    p, _ = run_swarm(procs, run_dir, values, manifest=MANIFESTS / "fgdiloco-local-cpu.yaml")
    report = finish(p, run_dir)
    assert report["steps"] == 16 and report["samples_lost"] == 0
    first = sum(v for _, v in report["loss"][:3]) / 3
    assert report["final_loss"] < first - 0.3, report["loss"]
    for name, stage in by_stage(report).items():
        assert stage["outer_rounds"] == 4, stage  # 16 steps / H = 4
        assert stage["mix2_success_mean"] is not None and stage["mix2_success_mean"] > 0.8, stage
