"""The documents' ablations reproduced by the simulator (agoractl.runtime.scenarios): tiny models, CPU,
fixed seeds, in-process (no network). Each scenario runs once per module (a fixture) and the tests
assert the orderings issue 6 asks for; each scenario takes well under a minute on 2 CPU cores.

Where a documented ordering does not hold robustly at this scale the test says so (xfail with the
reason) instead of asserting something weaker under the same name.
"""

import pytest
import torch

from agoractl.manifest.loader import load_manifest
from agoractl.runtime import scenarios
from tests.conftest import MANIFESTS

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64",
        "model.seq_len=32", "model.ssn.rank=8", "stages=[{role: head, layers: 1}, {role: tail, layers: 1}]"]


def tiny_run(*extra):
    torch.set_num_threads(1)
    return load_manifest(MANIFESTS / "local-cpu.yaml", TINY + list(extra))


# ---- fgdiloco (seed 002) --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fg():
    return scenarios.fgdiloco(tiny_run(), replicas=4, rounds=12, inner_steps=8, batch=4, data="synthetic")


def test_fgdiloco_report_shape(fg):
    assert fg["scenario"] == "fgdiloco"
    assert set(fg["variants"]) == {"diloco", "global_m1", "global_m1_local_m2", "local_m1_m2"}
    for v in fg["variants"].values():
        assert {"final_loss", "loss", "utilization", "js_mean", "js_max", "l2_mean"} <= set(v)
        assert set(v["utilization"]) == {"100", "200"}
        assert len(v["loss"]) == 12 * 8
    assert fg["assumptions"]["payload_params"] == 1.5e9
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
    others = [f["diloco"], f["global_m1_local_m2"], f["global_m1"]]
    if not f["local_m1_m2"] >= max(others) - 0.01:
        pytest.xfail(f"LocalM1M2 is not the worst per step at this scale: {f}")
    assert f["local_m1_m2"] > f["diloco"]


def test_fgdiloco_non_blocking_sooner_at_100(fg):
    v = fg["variants"]
    diloco_hours = v["diloco"]["hours_to_diloco_final"]["100"]
    assert diloco_hours is not None
    gm1 = v["global_m1"]["hours_to_diloco_final"]["100"]
    assert gm1 is not None and gm1 < diloco_hours


def test_fgdiloco_global_m1_local_m2_sooner_at_100(fg):
    # The time model charges GlobalM1LocalM2 at 100 Mbit/s Mix1's overflow (global mixing of 1.5B fp32
    # parameters takes 720 s against 500 s of compute) plus a blocking pairwise Mix2 (480 s): 1200 s per
    # round against DiLoCo's 1220 s. It wins in time only when it also matches DiLoCo per step.
    v = fg["variants"]
    hours = v["global_m1_local_m2"]["hours_to_diloco_final"]["100"]
    if hours is None or hours >= v["diloco"]["hours_to_diloco_final"]["100"]:
        pytest.xfail(f"GlobalM1LocalM2 does not reach DiLoCo's final loss sooner at 100 Mbit/s: {hours} h "
                     f"(round {v['global_m1_local_m2']['round_wall_s']['100']} s vs DiLoCo "
                     f"{v['diloco']['round_wall_s']['100']} s)")


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
