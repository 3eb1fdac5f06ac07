"""The swarm's run report from its nodes' statistics (agoractl.training.swarm_report). Pure: typed
stats (agoractl.training.node_stats) in, dict out, no processes."""

from __future__ import annotations

import pytest

from agoractl.manifest.loader import load_manifest
from agoractl.training.node_stats import LostTrainer, TrainerNodeStats, WorkerNodeStats
from agoractl.training.swarm_report import aggregate
from tests.conftest import MANIFESTS


@pytest.fixture
def run():
    return load_manifest(MANIFESTS / "local-cpu.yaml", ["training.max_steps=3", "training.schedule.warmup_steps=1", "training.global_batch_size=4",
                                                        "trainers.microbatch=1",
                                                        "model.seq_len=32", "data_parallel.method=none"])


def worker(stage, peer, steps, t0, samples, coalesced=(2, 1), **more):
    return WorkerNodeStats(stage=stage, peer=peer, step=len(steps), backward_samples=samples,
                           steps=[[s, t0 + s, 4, 0.5] for s in steps], max_coalesced=max(coalesced),
                           coalesced_sum=sum(coalesced), batches={"forward": 1, "backward": len(coalesced) - 1},
                           **more)


def trainer(**fields):
    return TrainerNodeStats.from_dict(fields)


def test_report_aggregates_nodes_and_counts_killed_ones(run):
    workers = [worker("head", "h0", [0, 1, 2], 100.0, 12), worker("body-1", "b0", [0, 1, 2], 100.0, 7),
               WorkerNodeStats(stage="body-1", peer="b1", step=1, backward_samples=5, max_coalesced=3, killed=True),
               worker("tail", "t0", [0, 1, 2], 99.0, 12)]
    trainers = [
        trainer(**{"trainer": 0, "first_dispatch": 99.5, "dispatched": 8, "completed": 8, "lost": 0,
                   "loss": {"0": [10.0, 2], "1": [8.0, 2], "2": [6.0, 2], "3": [5.0, 2]},
                   "stages": {"body-1": {"retries": 2, "backward_fallbacks": 1, "bans": 1, "rejected": 1,
                                         "workers_seen": ["b0", "b1"]}},
                   "faults": {"bx": {"stage": "body-1", "non_finite": 1}}}),
        trainer(**{"trainer": 1, "first_dispatch": 99.0, "dispatched": 5, "completed": 4, "lost": 1,
                   "loss": {"0": [12.0, 2], "1": [9.0, 2], "2": [7.0, 2]}, "stages": {},
                   "faults": {"bx": {"stage": "body-1", "non_finite": 2, "magnitude": 1}}}),
    ]
    r = aggregate(run, workers, trainers, lost_trainers=[LostTrainer(trainer=2, in_flight=3)], fallback_elapsed_s=50.0)
    assert r["mode"] == "swarm" and r["steps"] == 3 and r["completed"]
    assert r["tokens"] == 3 * 4 * 32
    assert r["elapsed_s"] == pytest.approx(102.0 - 99.0)  # first dispatch to the last stage's final step
    assert r["loss"] == [[0, 5.5], [1, 4.25], [2, 3.25]]  # merged per step; the step past the end dropped
    assert r["step_samples"] == {"min": 4, "max": 4, "mean": 4.0}  # samples behind each step's loss
    assert r["startup_s"] is None  # no launch time given
    assert aggregate(run, workers, trainers, [], 50.0, launched=90.0)["startup_s"] == pytest.approx(99.0 - 90.0)
    assert r["samples_lost"] == 1 + 3  # a trainer's give-ups plus a dead trainer's in-flight samples
    body = next(s for s in r["stages"] if s["name"] == "body-1")
    assert body == {"name": "body-1", "workers_seen": 2, "steps": 3, "samples": 12, "max_coalesced": 3,
                    "mean_coalesced": 1.5, "retries": 2, "bans": 1, "rejected": 1, "backward_fallbacks": 1}
    # Faults per worker, summed over the trainers that rejected its replies.
    assert r["faults"] == {"bx": {"stage": "body-1", "trainers": 2, "non_finite": 3, "magnitude": 1}}


def test_a_run_cut_short_reports_the_slowest_stage(run):
    workers = [worker("head", "h0", [0], 10.0, 4), worker("body-1", "b0", [0, 1], 10.0, 8),
               worker("tail", "t0", [0, 1, 2], 10.0, 12)]
    r = aggregate(run, workers, [trainer(trainer=0, first_dispatch=9.0, loss={})], [], fallback_elapsed_s=7.0)
    assert r["steps"] == 1 and not r["completed"] and r["loss"] == [] and r["final_loss"] is None
    assert r["elapsed_s"] == pytest.approx(1.0)


def test_fgdiloco_stages_report_outer_rounds_and_mix_success():
    run = load_manifest(MANIFESTS / "fgdiloco-local-cpu.yaml", ["training.max_steps=3", "training.schedule.warmup_steps=1"])
    mixes = [{"mix": "mix1", "outer_round": 0, "status": "skipped"},
             {"mix": "mix2", "outer_round": 0, "status": "complete", "averaging_success": 1.0},
             {"mix": "mix1", "outer_round": 1, "status": "partial", "averaging_success": 0.5},
             {"mix": "mix2", "outer_round": 1, "status": "failed", "averaging_success": 0.0}]
    workers = [worker("head", "h0", [0, 1, 2], 100.0, 12, rounds=mixes, fgdiloco={"outer_rounds": 2}),
               worker("head", "h1", [0, 1, 2], 100.0, 12, rounds=mixes[:2], fgdiloco={"outer_rounds": 1})]
    r = aggregate(run, workers, [], lost_trainers=[], fallback_elapsed_s=5.0)
    head = next(s for s in r["stages"] if s["name"] == "head")
    assert head["outer_rounds"] == 2
    assert head["mix1_success_mean"] == 0.5  # the skipped Mix1 (nothing to mix) is left out
    assert head["mix2_success_mean"] == pytest.approx((1.0 + 0.0 + 1.0) / 3)
    tail = next(s for s in r["stages"] if s["name"] == "tail")
    assert tail["outer_rounds"] == 0 and tail["mix1_success_mean"] is None


def test_the_report_lists_each_nodes_summary_without_per_step_detail(run):
    workers = [worker(s, f"{s}-0", [0, 1, 2], 10.0, 12, pid=7, cpu_at_ready_s={"node": 1.0}) for s in run.stage_names()]
    trainers = [trainer(trainer=0, first_dispatch=9.0, dispatched=12, pid=8,
                        stages={"head": {"retries": 1, "workers_seen": ["head-0"]}})]
    r = aggregate(run, workers, trainers, [], fallback_elapsed_s=7.0)
    head = r["workers"][0]
    assert head["peer"] == "head-0" and head["backward_samples"] == 12 and head["cpu_at_ready_s"] == {"node": 1.0}
    assert head["killed"] is False
    assert not {"steps", "rounds", "pid", "kind", "dht_calls"} & set(head)
    assert r["trainers"] == [{"trainer": 0, "peer": "", "dispatched": 12, "completed": 0, "lost": 0, "lost_at": {},
                              "sequences": [], "first_dispatch": 9.0, "finished_reason": "", "checks_s": 0.0, "cpu_s": None,
                              "cpu_at_start_s": None, "resumed": None}]
