"""Tests of ``agoractl analyze divergence`` as a real subprocess on snapshots written to a local store:
the JSON keys, a PNG plot, the human table, a text probe, and exit codes for bad requests. Each test's
invocations share one interpreter (``cli.batch``)."""

from __future__ import annotations

import json

import torch

from agoractl.ops.checkpoint import CheckpointStore
from tests.conftest import MANIFESTS
from tests.ops.test_analyze import _identical_and_noisy, _run

torch.set_num_threads(1)
FILE = MANIFESTS / "local-cpu.yaml"


def test_divergence_json_plot_and_table(cli, tmp_path):
    run = _run(tmp_path)
    _identical_and_noisy(run, CheckpointStore(run), noisy_stage=0, eps={10: 0.01, 20: 0.02, 30: 0.04})
    sets = ["--set", f"checkpoints.store={tmp_path}/store", "--set", f"data.output={tmp_path}/no-shards"]
    (tmp_path / "probe.txt").write_text("The consensus of replicas is measured on a fixed probe text. " * 20)
    r, human = cli.batch(["analyze", "divergence", FILE, "--stage", "head", "--steps", "10,30", "--probe",
                          tmp_path / "probe.txt", "--probe-batch", 2, "--plot", tmp_path / "fig" / "head.png", *sets,
                          "--json"],
                         ["analyze", "divergence", FILE, "--stage", "head", "--no-js", *sets])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("stage", "steps", "segment_variance", "consensus_movement", "l2_mean", "js_mean", "js_max"):
        assert key in out, key
    assert out["stage"] == "head" and out["steps"] == [10, 30]
    assert len(out["segment_variance"]["30"]) == 20
    assert out["consensus_movement"]["10"] is None and out["consensus_movement"]["30"] > 0
    assert 0 < out["js_mean"]["10"] < out["js_mean"]["30"] <= out["js_max"]["30"]
    assert out["probe"] == {"kind": "file", "path": str(tmp_path / "probe.txt"), "sequences": 2, "tokens": 128}
    png = (tmp_path / "fig" / "head.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert [p.name for p in (tmp_path / "fig").iterdir()] == ["head.png"]
    r = human
    assert r.returncode == 0, r.stderr
    assert "divergence of stage head" in r.stdout and "lowest segment" in r.stdout
    assert r.stdout.count("\n") > 6


def test_divergence_bad_requests(cli, tmp_path):
    sets = ["--set", f"checkpoints.store={tmp_path}/store"]
    r, nothing = cli.batch(["analyze", "divergence", FILE, "--stage", "middle", *sets],
                           ["analyze", "divergence", FILE, "--stage", "head", *sets])
    assert r.returncode == 2, r.stderr
    assert "--stage middle: no such stage; stages are head, body-1, tail" in r.stderr
    r = nothing
    assert r.returncode == 1, r.stderr
    assert "no replica snapshots of stage head" in r.stderr and "snapshots_every_steps" in r.stderr
    assert "Traceback" not in r.stderr
