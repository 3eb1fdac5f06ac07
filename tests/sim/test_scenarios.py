"""The documents' ablations reproduced by the simulator (agoractl.sim.scenarios): tiny models, CPU,
fixed seeds, in-process (no network). Each scenario runs once per module (a fixture) and the tests
assert the orderings issue 6 asks for; each scenario takes well under a minute on 2 CPU cores.

LocalM1M2 against GlobalM1 per step is not asserted: the seed's F > 2 bounds the consensus error; it
does not order the losses (the test asserts the consensus error itself).

fgdiloco: the learning runs on 4 simulated replicas. The seed's M = 8 was tried: its fixture alone took
47-67 s of CPU here, and at the same global batch (2 samples per replica) its per-step ordering is
noise (seed 1: LocalM1M2 and GlobalM1LocalM2 below DiLoCo). Pairwise mixing is about as far from
global at 8 as at 4: a random matching keeps (M-2)/(2(M-1)) of the squared disagreement, 1/3 at M = 4,
3/7 at M = 8. The time model is the seed's regime (1.5B parameters, H = 100, M = 8, gossip accounting
of global mixing, step time calibrated to the seed's 29 vs 16 weeks at 200 Mbit/s; see
agoractl.sim.scenarios).
"""

import fcntl
import itertools
import json

import pytest
import torch

from agoractl.manifest.loader import load_manifest
from agoractl.sim import scenarios
from tests.conftest import MANIFESTS, private_shards

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64",
        "model.seq_len=32", "model.ssn.rank=8", "stages=[{role: head, layers: 1}, {role: tail, layers: 1}]"]


def tiny_run(*extra):
    torch.set_num_threads(1)
    return load_manifest(MANIFESTS / "local-cpu.yaml", TINY + list(extra))


# ---- fgdiloco (seed 002) --------------------------------------------------------------------------


def _fgdiloco():
    return scenarios.fgdiloco(tiny_run(), replicas=4, rounds=12, inner_steps=8, batch=4, data="synthetic", seed=0)


@pytest.fixture(scope="session")
def fg(tmp_path_factory, worker_id):
    """The scenario, computed once per test run: the first xdist worker to need it computes it under a
    file lock and leaves its JSON in the run's shared temporary directory for the other worker."""
    if worker_id == "master":
        return _fgdiloco()
    path = tmp_path_factory.getbasetemp().parent / "fgdiloco-scenario.json"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            path.write_text(json.dumps(_fgdiloco()))
        return json.loads(path.read_text())


def test_fgdiloco_report_shape(fg):
    assert fg["scenario"] == "fgdiloco"
    assert set(fg["variants"]) == {"diloco", "global_m1", "global_m1_local_m2", "local_m1_m2"}
    for v in fg["variants"].values():
        assert {"final_loss", "loss", "utilization", "js_mean", "js_max", "l2_mean"} <= set(v)
        assert set(v["utilization"]) == {"100", "200"}
        assert len(v["loss"]) == 12 * 8
    a = fg["assumptions"]
    assert a["payload_params"] == 1.5e9 and a["inner_steps_per_round"] == 100 and a["replicas"] == 8
    assert a["global_mixing"] == "all-to-all"
    assert a["step_time_s"] == pytest.approx(scenarios.seed_step_time_s())
    assert fg["data"].startswith("synthetic")


def test_fgdiloco_all_variants_learn(fg):
    for v in fg["variants"].values():
        assert v["loss"][-1] < v["loss"][0] - 2.0


def test_fgdiloco_per_step_order_small_gaps(fg):
    # DiLoCo ≲ GlobalM1LocalM2 ≲ GlobalM1 per step, with small gaps (final_loss: the last round's mean
    # loss over 8 steps x 4 replicas x 4 new samples).
    f = {k: v["final_loss"] for k, v in fg["variants"].items()}
    assert f["diloco"] <= f["global_m1_local_m2"] + 0.01
    assert f["global_m1_local_m2"] <= f["global_m1"] + 0.01
    assert f["global_m1"] - f["diloco"] < 0.15


def test_fgdiloco_local_m1_m2_worst_per_step(fg):
    f = {k: v["final_loss"] for k, v in fg["variants"].items()}
    # LocalM1M2 below the variants with a better consensus factor F = 1 + rho2 / (1 - rho1): DiLoCo (1)
    # and GlobalM1LocalM2 (1 + rho) ...
    assert f["local_m1_m2"] > f["diloco"]
    assert f["local_m1_m2"] >= f["global_m1_local_m2"] - 0.01
    # What the seed claims of LocalM1M2 beyond that is a consensus error (its F > 2 is a bound on it,
    # not a measured ordering against GlobalM1): purely local mixing leaves the replicas apart, where
    # DiLoCo's global outer step keeps them identical.
    v = fg["variants"]
    assert v["local_m1_m2"]["js_mean"] > 0.0 == v["diloco"]["js_max"]
    assert v["local_m1_m2"]["l2_mean"] > 0.0


def test_fgdiloco_non_blocking_sooner_at_100(fg):
    v = fg["variants"]
    diloco_hours = v["diloco"]["hours_to_diloco_final"]["100"]
    assert diloco_hours is not None
    gm1 = v["global_m1"]["hours_to_diloco_final"]["100"]
    assert gm1 is not None and gm1 < diloco_hours


def test_fgdiloco_global_m1_local_m2_sooner_at_100(fg):
    # At 100 Mbit/s, M = 8: Mix1's global mixing (7 x 480 s) outlasts the round's 2068 s of compute, then
    # the blocking pairwise Mix2 (480 s): 3840 s per round against DiLoCo's 2068 + 3360 s.
    v = fg["variants"]
    assert v["global_m1_local_m2"]["round_wall_s"]["100"] < 0.75 * v["diloco"]["round_wall_s"]["100"]
    hours = v["global_m1_local_m2"]["hours_to_diloco_final"]["100"]
    assert hours is not None and hours < v["diloco"]["hours_to_diloco_final"]["100"], v["global_m1_local_m2"]


def test_fgdiloco_utilization(fg):
    u = {k: v["utilization"] for k, v in fg["variants"].items()}
    for bw in ("100", "200"):
        assert u["global_m1"][bw] > u["diloco"][bw]
        assert u["global_m1_local_m2"][bw] >= u["diloco"][bw]
        assert u["diloco"][bw] < 1.0
    assert u["diloco"]["200"] > u["diloco"]["100"]
    assert u["global_m1"]["200"] == 1.0          # its Mix1 hides entirely under compute at 200 Mbit/s


def test_fgdiloco_global_m1_drifts_most(fg):
    v = fg["variants"]
    assert v["diloco"]["js_max"] == 0.0          # globally synchronised
    for name in ("global_m1_local_m2", "local_m1_m2"):
        assert v["global_m1"]["js_max"] > v[name]["js_max"]
        assert v["global_m1"]["js_mean"] > v[name]["js_mean"]


# ---- sparta-backward (report §6.2) ----------------------------------------------------------------


def test_sparta_pinned_backward_beats_stochastic():
    run = tiny_run("training.global_batch_size=16")
    out = scenarios.sparta_backward(run, replicas=4, steps=100, microbatch=4, data="synthetic")
    pinned, stochastic = out["variants"]["pinned"], out["variants"]["stochastic"]
    assert len(pinned["loss"]) == 100
    assert pinned["loss"][-1] < pinned["loss"][0] - 2.0
    assert pinned["final_loss"] < stochastic["final_loss"] - 0.05, out["variants"]


# ---- sparta-participation (report §6.4) -----------------------------------------------------------


def test_sparta_participation_below_85_slows_and_recovers():
    # Frequent rounds over a large fraction, so that averaging (and its failure) matters at tiny scale.
    run = tiny_run("training.global_batch_size=16", "data_parallel.sparta.fraction=0.25",
                   "data_parallel.sparta.every_steps=1")
    out = scenarios.sparta_participation(run, replicas=4, levels=(1.0, 0.9, 0.75, 0.5), warmup_steps=20,
                                         failure_steps=50, recovery_steps=30, microbatch=8, data="synthetic")
    v = out["variants"]
    assert set(v) == {"p100", "p90", "p75", "p50"}
    assert v["p100"]["participation_failure_phase"] == 1.0
    assert v["p75"]["participation_failure_phase"] < 0.85
    base = v["p100"]
    for name in ("p75", "p50"):
        # Sustained participation below ~85% slows loss reduction compared with 100% ...
        assert v[name]["reduction_failure"] < base["reduction_failure"] - 0.03, v[name]
        # ... and the loss recovers once failures stop: it falls at least as fast as at 100%, and the
        # gap does not grow.
        assert v[name]["reduction_recovery"] >= base["reduction_recovery"] - 0.005, v[name]
        assert v[name]["gap_end"] <= v[name]["gap_failure_end"] + 0.002, v[name]
    # The slowdown grows as participation falls. (At this scale 90% slows loss reduction too, by a
    # varying amount: the report's ~85% threshold shows as a graded effect, so p90 is not asserted.)
    assert v["p75"]["gap_failure_end"] < v["p50"]["gap_failure_end"]


# ---- data -----------------------------------------------------------------------------------------


def test_data_trains_from_the_first_sequence_and_probes_past_the_training(sample_shards, tmp_path):
    """simulate trains on the samples a live run's trainer reads, from the first one, in the same order (issue
    24: its 16-sequence probe used to be cut from the head of the stream, which shifted every step's batch);
    the probe is the sequences after the most a simulated run may train on, so it is never trained on."""
    from agoractl.data.stream import run_sequences

    run = load_manifest(MANIFESTS / "fgdiloco-dp-cpu.yaml", private_shards(sample_shards, tmp_path))
    data = scenarios.Data(run, "shards", 0, probe_samples=4, train_samples=40)
    head = torch.stack(list(itertools.islice(run_sequences(run), 44)))
    assert torch.equal(torch.stack(list(itertools.islice(data.stream(), 40))), head[:40])
    assert torch.equal(data.probe, head[40:])
    assert data.probe_source.startswith("the 4 sequences after the first 40")
    # Shards too small to hold both: the probe is lesson text, never a sample the run trains on.
    small = scenarios.Data(run, "shards", 0, probe_samples=4, train_samples=10**6)
    assert "another generator seed" in small.probe_source and small.probe.shape == data.probe.shape
