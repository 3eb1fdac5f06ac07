"""A node's final statistics (agoractl.training.node_stats): the JSON a worker or trainer writes reads
back as the same typed stats, and a field one side does not know fails loudly, naming it. In-memory."""

from __future__ import annotations

import json

import pytest

from agoractl.training.node_stats import TrainerNodeStats, TrainerStageStats, WorkerNodeStats, summary


def test_worker_stats_round_trip_through_json():
    stats = WorkerNodeStats(peer="p", stage="head", step=3, backward_samples=12, steps=[[0, 1.0, 4, 0.5]],
                            rounds=[{"round": 0, "status": "complete"}], sparta={"rounds": 1},
                            cpu_at_ready_s={"node": 4.2, "dht": 0.5, "p2pd": 0.1})
    back = WorkerNodeStats.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert back == stats and back.kind == "worker"


def test_trainer_stats_round_trip_through_json_with_typed_stage_counters():
    stats = TrainerNodeStats(trainer=1, loss={0: [10.0, 2], 1: [8.0, 2]}, tokens={3: 100},
                             stages={"head": TrainerStageStats(retries=2, workers_seen=["a"])})
    d = json.loads(json.dumps(stats.to_dict()))
    assert d["loss"] == {"0": [10.0, 2], "1": [8.0, 2]} and d["tokens"] == {"3": 100}
    back = TrainerNodeStats.from_dict(d)
    assert back.stages["head"] == TrainerStageStats(retries=2, workers_seen=["a"])
    assert back.loss == {"0": [10.0, 2], "1": [8.0, 2]}  # JSON keys: the report converts them


def test_a_field_one_side_does_not_know_fails_naming_it():
    with pytest.raises(ValueError, match="worker statistics have unknown field.* backward_samplez"):
        WorkerNodeStats.from_dict({"stage": "head", "backward_samplez": 3})
    with pytest.raises(ValueError, match="trainer stage head statistics have unknown field.* retry"):
        TrainerNodeStats.from_dict({"trainer": 0, "stages": {"head": {"retry": 1}}})
    with pytest.raises(ValueError, match="not an object"):
        TrainerNodeStats.from_dict([1, 2])
    with pytest.raises(TypeError, match="unexpected keyword"):  # the writer side: a data-parallel summary's key
        WorkerNodeStats(stage="head", **{"spartaa": {}})


def test_summary_leaves_out_detail_fields():
    s = summary(WorkerNodeStats(peer="p", steps=[[0, 1.0, 4, 0.5]]))
    assert s["peer"] == "p" and "steps" not in s and "failed_batches" not in s and "pid" not in s
    assert set(summary(TrainerNodeStats())) == {"trainer", "peer", "dispatched", "completed", "lost", "lost_at",
                                                "sequences", "first_dispatch", "finished_reason", "checks_s", "cpu_s",
                                                "cpu_at_start_s", "resumed"}
