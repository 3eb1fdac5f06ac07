"""Tests of the simulator's core (agoractl.sim.simulator): in-process, tiny models, no network.

They check that the simulator wires the shared maths the way the documents describe: data split
across replicas, DiLoCo's round as parameter averaging, pipeline routing through real stage modules
(equal to the monolithic model), pinned vs stochastic backward, AsyncSPARTA rounds and failures.
"""

import pytest
import torch

from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.loader import load_manifest
from agoractl.model.build import build_model
from agoractl.model.llama import lm_loss, split_sample
from agoractl.sim.simulator import (Batcher, FGDiLoCoSim, PipelineSim, Replica, assign_parameters_,
                                        flat_parameters, lesson_sequences, open_sequences)
from tests.conftest import MANIFESTS

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64",
        "model.seq_len=16", "model.ssn.rank=8", "stages=[{role: head, layers: 1}, {role: tail, layers: 1}]",
        "training.global_batch_size=4", "trainers.microbatch=1", "training.max_steps=20"]


def tiny_run(*extra):
    torch.set_num_threads(1)
    return load_manifest(MANIFESTS / "local-cpu.yaml", TINY + list(extra))


def test_lesson_sequences_are_deterministic_packed_samples():
    run = tiny_run()
    a, b = lesson_sequences(run, 0), lesson_sequences(run, 0)
    xs = [next(a) for _ in range(5)]
    assert all(x.shape == (17,) and x.dtype == torch.long for x in xs)
    assert all(torch.equal(x, next(b)) for x in xs)
    assert int(torch.stack(xs).max()) < run.model.vocab_size
    assert not torch.equal(next(lesson_sequences(run, 1)), xs[0])


def test_open_sequences_auto_falls_back_to_synthetic(tmp_path):
    run = tiny_run(f"data.output={tmp_path / 'shards'}")
    _, desc = open_sequences(run, "auto")
    assert desc.startswith("synthetic")
    with pytest.raises(RuntimeFailure, match="no shard index"):
        next(open_sequences(run, "shards")[0])
    with pytest.raises(UsageError, match="--data"):
        open_sequences(run, "parquet")


def test_batcher_reports_exhausted_stream():
    with pytest.raises(RuntimeFailure, match="ran out"):
        Batcher(iter([torch.zeros(3, dtype=torch.long)])).take(2)


def test_replicas_start_identical_and_inner_steps_learn():
    run = tiny_run()
    a, b = Replica(run), Replica(run)
    assert torch.equal(flat_parameters(a.model), flat_parameters(b.model))
    batch = Batcher(lesson_sequences(run)).take(4)
    first = a.inner_step(batch)
    for _ in range(15):
        last = a.inner_step(batch)
    assert last < first - 0.5
    assert a.step == 16


def test_diloco_round_without_momentum_is_parameter_averaging():
    # DiLoCo with outer lr 1 and no momentum: z_{r+1} = z + mean(Δ) = mean(y_H).
    run = tiny_run("data_parallel.fgdiloco.outer_lr=1.0", "data_parallel.fgdiloco.outer_momentum=0.0")
    sim = FGDiLoCoSim(run, "diloco", replicas=2, inner_steps=3, batch=2)
    solo = [Replica(run), Replica(run)]
    samples = Batcher(lesson_sequences(run)).take(12)
    sim.round(Batcher(iter(samples)))
    # The same split by hand: step k gives replica 0 samples [4k, 4k+2), replica 1 [4k+2, 4k+4).
    for k in range(3):
        solo[0].inner_step(samples[4 * k:4 * k + 2])
        solo[1].inner_step(samples[4 * k + 2:4 * k + 4])
    expected = (flat_parameters(solo[0].model) + flat_parameters(solo[1].model)) / 2
    for rep in sim.replicas:
        assert torch.allclose(flat_parameters(rep.model), expected, atol=1e-6)


def test_variants_drift_or_stay_in_consensus():
    run = tiny_run()
    probe = Batcher(lesson_sequences(run, 7)).take(4)
    out = {}
    for variant in ("diloco", "global_m1"):
        sim = FGDiLoCoSim(run, variant, replicas=3, inner_steps=3, batch=2)
        batcher = Batcher(lesson_sequences(run))
        sim.round(batcher)
        sim.round(batcher)
        out[variant] = sim.consensus(probe)
    assert out["diloco"]["js_max"] == 0.0 and out["diloco"]["l2_mean"] == 0.0
    assert out["global_m1"]["js_max"] > 0 and out["global_m1"]["l2_mean"] > 0


def test_assign_parameters_round_trips():
    model = build_model(tiny_run())
    flat = flat_parameters(model)
    assign_parameters_(model, flat * 2)
    assert torch.allclose(flat_parameters(model), flat * 2)


def pipeline_and_monolithic_loss(run):
    """(the one-replica pipeline simulation's loss, the monolithic model's loss, that model) on 2 samples."""
    sim = PipelineSim(run, replicas=1)
    model = build_model(run)
    samples = Batcher(lesson_sequences(run)).take(2)
    inputs, labels = split_sample(samples)
    with torch.no_grad():
        expected = float(lm_loss(model(inputs), labels))
    return sim.microbatch(samples), expected, model


def test_pipeline_with_one_replica_matches_the_monolithic_model():
    # Routing through the stage modules (with the SSN codec on the boundary) computes the whole model.
    sim, expected, _ = pipeline_and_monolithic_loss(tiny_run())
    assert sim == pytest.approx(expected, rel=1e-5)


def test_stochastic_backward_with_one_replica_equals_pinned():
    run = tiny_run()
    sims = [PipelineSim(run, replicas=1, backward=rule) for rule in ("pinned", "stochastic")]
    samples = Batcher(lesson_sequences(run)).take(4)
    for sim in sims:
        sim.train_step(samples, microbatch=2)
    for a, b in zip(sims[0].stages, sims[1].stages):
        for n, p in a[0].params.items():
            assert torch.equal(p, b[0].params[n])


def test_stochastic_backward_reroutes_with_the_same_forward_routes():
    run = tiny_run()
    pinned = PipelineSim(run, replicas=3, backward="pinned", seed=3)
    stochastic = PipelineSim(run, replicas=3, backward="stochastic", seed=3)
    samples = Batcher(lesson_sequences(run)).take(2)
    losses = [[sim.microbatch(samples) for _ in range(8)] for sim in (pinned, stochastic)]
    # The first forward is the same route on the same (untouched) weights in both.
    assert losses[0][0] == pytest.approx(losses[1][0])
    counts = [[[rep.microbatches for rep in stage] for stage in sim.stages] for sim in (pinned, stochastic)]
    # Pinned: both stages' backward counts follow the same forward routes; stochastic draws anew.
    assert counts[0] != counts[1]
    assert all(sum(stage) == 8 for sim in counts for stage in sim)


def test_sparta_round_full_fraction_reaches_consensus():
    run = tiny_run("data_parallel.sparta.fraction=1.0", "data_parallel.sparta.every_steps=1")
    sim = PipelineSim(run, replicas=3, lag_steps=0)
    batcher = Batcher(lesson_sequences(run))
    sim.train_step(batcher.take(4), microbatch=1)
    for stage in sim.stages:
        for n, p in stage[0].params.items():
            for rep in stage[1:]:
                assert torch.allclose(rep.params[n], p, atol=1e-6)
    assert sim.participation == [(1, 1.0)]


def test_failed_round_keeps_local_values():
    run = tiny_run("data_parallel.sparta.fraction=1.0", "data_parallel.sparta.every_steps=1")
    sim = PipelineSim(run, replicas=3, lag_steps=0)
    sim.train_step(Batcher(lesson_sequences(run)).take(4), microbatch=1, participation=1e-12)
    assert sim.participation == [(1, 0.0)]
    head = sim.stages[0]
    trained = [rep for rep in head if any(not torch.equal(p, head[0].params[n]) for n, p in rep.params.items())]
    assert trained, "replicas that trained on different samples must differ when no round completes"


def test_lagged_round_applies_with_the_delta_rule():
    # Full fraction, one round started at step 1 and landing one step later: whatever a replica learned
    # in between is kept (report eq. 8), so theta_j = avg + (its local progress since the snapshot).
    run = tiny_run("data_parallel.sparta.fraction=1.0", "data_parallel.sparta.every_steps=1")
    sim = PipelineSim(run, replicas=2, lag_steps=1)
    sim.train_step(Batcher(lesson_sequences(run)).take(4), microbatch=1)
    assert len(sim.pending) == len(run.stages) and sim.pending[0][0] == 2
    head = sim.stages[0]
    progress = []
    with torch.no_grad():
        for j, rep in enumerate(head):             # stand-in for a local step: a known change per replica
            d = {n: torch.full_like(p, 0.01 * (j + 1)) for n, p in rep.params.items()}
            for n, p in rep.params.items():
                p.add_(d[n])
            progress.append(d)
    snaps = [e for e in sim.pending if e[1] == 0][0][3]
    average = [e for e in sim.pending if e[1] == 0][0][4]
    sim.step += 1
    sim._apply_due()
    assert not sim.pending
    for j, rep in enumerate(head):
        got = sim.tilings[0].gather(rep.params, 0)
        want = average + sim.tilings[0].gather(progress[j], 0)
        assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(snaps[0], snaps[1])


def test_eval_loss_covers_routes():
    run = tiny_run()
    sim = PipelineSim(run, replicas=3)
    assert len(sim.routes()) == 9
    assert len(sim.routes(limit=4)) == 4
    probe = Batcher(lesson_sequences(run, 5)).take(2)
    assert sim.eval_loss(probe) == pytest.approx(sim.eval_loss(probe))


def test_a_whole_stage_runs_in_both_simulations():
    # One stage of role whole: the pipeline simulation is the monolithic model, and a FGDiLoCo replica
    # clips the whole model as one group at 1/sqrt(1) = 1 (what central's global clipping does).
    run = tiny_run("stages=[{role: whole, layers: 2}]")
    sim, expected, model = pipeline_and_monolithic_loss(run)
    assert sim == pytest.approx(expected, rel=1e-6)
    (params, threshold), = Replica(run).groups
    assert len(params) == len(list(model.parameters())) and threshold == 1.0
