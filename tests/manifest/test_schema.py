"""Tests of the manifest schema (agoractl.manifest.schema): defaults from the report, derived values,
JSON Schema, and every shipped manifest validating. In-memory."""

import math

import pytest

from agoractl.manifest.loader import ManifestError, load_manifest
from agoractl.manifest.schema import Run, Stage
from tests.conftest import MANIFESTS


@pytest.mark.parametrize("path", sorted(MANIFESTS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_manifest_validates(path):
    run = load_manifest(path)
    assert run.metadata.name == path.stem


def test_report_defaults():
    run = Run()
    sp = run.data_parallel.sparta
    assert (sp.fraction, sp.every_steps, sp.delta_rule, sp.allreduce_timeout_s) == (0.05, 20, True, 150.0)
    assert run.n_segments() == 20
    assert run.join.weight_sync_steps == 400 and run.join.optimizer_sync_steps == 100
    assert (run.admission.min_vram_gb, run.admission.min_ram_gb, run.admission.min_bandwidth_mbps,
            run.admission.max_latency_ms) == (24, 80, 200, 80)
    st = run.workers.self_termination
    assert (st.allreduce_failures, st.window_rounds) == (2, 3)
    assert run.trainers.shards_per_trainer == 3


def test_stagewise_clip_thresholds():
    run = load_manifest(MANIFESTS / "pluralis-8b.yaml")
    s = 1 / math.sqrt(7)
    assert run.clip_threshold(0) == pytest.approx(s)
    assert run.clip_threshold(3) == pytest.approx(s)
    assert run.clip_threshold(6) == pytest.approx(2 * s)


def test_stage_names_and_ranges():
    run = load_manifest(MANIFESTS / "pluralis-8b.yaml")
    assert run.stage_names() == ["head", "body-1", "body-2", "body-3", "body-4", "body-5", "tail"]
    assert run.layer_range(1) == (6, 10)
    assert run.stage("tail")[0] == 6
    with pytest.raises(KeyError, match="stages are"):
        run.stage("body-9")


def test_programmatic_construction_checks_cross_fields():
    with pytest.raises(ValueError, match="sum to"):
        Run(stages=[Stage(role="head", layers=1), Stage(role="tail", layers=1)])


def test_json_schema_documents_fields():
    schema = Run.model_json_schema()
    sparta = schema["$defs"]["Sparta"]["properties"]["fraction"]
    assert "segments" in sparta["description"]
    assert schema["$defs"]["Sparta"]["additionalProperties"] is False


def test_until_step_stops_a_launch_within_max_steps():
    from agoractl.manifest.schema import Training

    assert Run().training.stop_step == Run().training.max_steps
    assert Run(training=Training(max_steps=40, until_step=20)).training.stop_step == 20
    with pytest.raises(ValueError, match="training.until_step: exceeds training.max_steps"):
        Run(training=Training(max_steps=10, until_step=20))


def test_fgdiloco_replicas_set_each_replicas_batch_and_must_divide_the_global_batch():
    run = load_manifest(MANIFESTS / "fgdiloco-dp-cpu.yaml")
    assert run.data_parallel.fgdiloco.replicas == 2 and run.replica_batch == 4
    fed = ["workers.self_feed=false", "local.trainers=1"]  # collective counts: trainers feed the replicas
    unset = load_manifest(MANIFESTS / "fgdiloco-dp-cpu.yaml", ["data_parallel.fgdiloco.replicas=null", *fed])
    assert unset.replica_batch is None
    sparta = load_manifest(MANIFESTS / "fgdiloco-dp-cpu.yaml", ["data_parallel.method=sparta", *fed])
    assert sparta.replica_batch is None
    with pytest.raises(ManifestError, match="data_parallel.fgdiloco.replicas: must divide training.global_batch_size"):
        load_manifest(MANIFESTS / "fgdiloco-dp-cpu.yaml", ["data_parallel.fgdiloco.replicas=3"])
    # A pipeline of M replicas per stage on their own counts: M pipelines, each a whole model (the shipped one).
    assert load_manifest(MANIFESTS / "fgdiloco-local-cpu.yaml").replica_batch == 4


def test_a_run_of_one_whole_stage_is_valid_and_whole_only_stands_alone():
    run = load_manifest(MANIFESTS / "fgdiloco-dp-cpu.yaml")
    assert run.stage_names() == ["whole"] and run.layer_range(0) == (0, run.model.n_layers)
    assert run.stages[0].embeds and run.stages[0].computes_loss
    assert run.clip_threshold(0) == 1.0  # stage-wise over one stage = global clipping; no tail multiplier
    with pytest.raises(ValueError, match=r"stages\[0\].role: a single stage holds the whole model"):
        Run(stages=[Stage(role="tail", layers=4)])
    with pytest.raises(ValueError, match=r"stages\[1\].role: whole is for a run of one stage"):
        Run(stages=[Stage(role="head", layers=2), Stage(role="whole", layers=2)])
    with pytest.raises(ValueError, match="at least one stage|needs one stage"):
        Run(stages=[])
