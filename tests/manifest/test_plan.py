"""Tests of `manifest plan` numbers (agoractl.manifest.plan) against the report. In-memory."""

import pytest

from agoractl.manifest.loader import load_manifest
from agoractl.manifest.plan import make_plan
from tests.conftest import MANIFESTS


def test_ablation_1b_parameter_totals_match_report():
    p = make_plan(load_manifest(MANIFESTS / "ablation-1b.yaml"))
    assert p["dense_params"] == pytest.approx(1.40e9, rel=0.05)   # report §6.1: ~1.40B dense-equivalent
    assert p["params"] == pytest.approx(0.94e9, rel=0.05)         # ~0.94B trainable
    head, body = p["stages"][0], p["stages"][1]
    assert 1 - head["params"] / head["dense_params"] == pytest.approx(0.50, abs=0.03)
    assert 1 - body["params"] / body["dense_params"] == pytest.approx(0.35, abs=0.03)


def test_pluralis_8b_bandwidth_reproduces_report():
    run = load_manifest(MANIFESTS / "pluralis-8b.yaml")
    p = make_plan(run)
    body = next(s for s in p["stages"] if s["role"] == "body")
    assert body["layers"][1] - body["layers"][0] == 4
    assert body["dense_params"] == pytest.approx(0.9e9, rel=0.05)
    assert p["dense_params"] == pytest.approx(8.6e9, rel=0.02)     # report §4.1: 8.6B
    bw = p["required_bandwidth_mbps"]
    assert bw["stage"] == body["name"]
    assert bw["bf16"] == pytest.approx(113, rel=0.15)              # report §3.5.2.1
    assert bw["fp32"] == pytest.approx(186, rel=0.15)
    b = p["boundary_bytes_per_token"]
    assert b["dense"] / b["compressed"] == run.model.d_model / run.model.ssn.rank


def test_sparta_payload_and_memory():
    run = load_manifest(MANIFESTS / "local-cpu.yaml")
    p = make_plan(run)
    for s in p["stages"]:
        assert s["sparta_bytes_per_round"] == int(0.05 * s["params"] * 4)
        assert s["memory_bytes"] == 16 * s["params"] + 4 * s["buffers"]
    assert p["sparta_segments"] == 20


def test_bandwidth_assumptions_are_parameters():
    run = load_manifest(MANIFESTS / "pluralis-8b.yaml")
    slow = make_plan(run, ar_time_s=20)["required_bandwidth_mbps"]["fp32"]
    fast = make_plan(run)["required_bandwidth_mbps"]["fp32"]
    assert slow < fast
    trainable = make_plan(run, ar_params="trainable")["required_bandwidth_mbps"]["bf16"]
    assert trainable < make_plan(run)["required_bandwidth_mbps"]["bf16"]


def test_a_whole_stage_plans_the_whole_model_and_no_boundary():
    run = load_manifest(MANIFESTS / "fgdiloco-dp-cpu.yaml")
    pipeline = load_manifest(MANIFESTS / "fgdiloco-local-cpu.yaml", ["model.ssn.rank=null"])
    whole, split = make_plan(run), make_plan(pipeline)
    assert [s["role"] for s in whole["stages"]] == ["whole"]
    assert whole["params"] == split["params"]  # same model, not split
    assert whole["stages"][0]["flops_per_sample"] == sum(s["flops_per_sample"] for s in split["stages"])
    assert whole["boundary_bytes_per_token"]["dense"] == 0
    # Only the all-reduce: FGDiLoCo sends every parameter, in 32 bits, every ar_time_s (10 s).
    assert whole["required_bandwidth_mbps"]["fp32"] == pytest.approx(32 * whole["params"] / 10 / 1e6)
