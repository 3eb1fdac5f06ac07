"""``agoractl launch central``: the centralized reference trains on real shards (sample corpus → shard →
central, each a real subprocess) and writes the run report; bad input fails with one line. CPU only."""

from __future__ import annotations

import json

from tests.conftest import MANIFESTS

LOCAL = MANIFESTS / "local-cpu.yaml"
SMALL = ["--set", "data.num_shards=4", "--set", "model.seq_len=64"]


def test_central_trains_and_writes_the_run_report(cli, tmp_path):
    cli("data", "sample", "--out", "runs/local-cpu/sample", "--rows", "600", "--files", "2", check=0)
    cli("shard", LOCAL, "--jobs", "1", *SMALL, check=0)
    proc = cli("launch", "central", LOCAL, *SMALL, "--set", "training.max_steps=25",
               "--set", "training.schedule.warmup_steps=3", "--log-every", "5", "--json", check=0)
    report = json.loads(proc.stdout)  # nothing but JSON on stdout
    assert "step 25/25" in proc.stderr

    assert report["steps"] == 25 and report["completed"]
    assert report["tokens"] == 25 * 16 * 64
    assert report["tokens_per_s"] > 0
    assert [s for s, _ in report["loss"]] == list(range(25))
    first, final = report["loss"][0][1], report["final_loss"]
    assert 5.0 < first < 6.0  # ~ln(257): an untrained byte model
    assert final < first - 1.5, report["loss"]  # the loss falls clearly
    assert set(report["grad_norm"][0][1]) == {"head", "body-1", "tail"}  # clipped stage by stage

    on_disk = json.loads((tmp_path / "runs/local-cpu/central-report.json").read_text())
    assert on_disk == {k: v for k, v in report.items() if k != "report_path"}
    assert not list((tmp_path / "runs/local-cpu").glob(".*.tmp"))  # written atomically


def test_central_without_shards_fails_with_one_line(cli):
    proc = cli("launch", "central", LOCAL, "--json", check=1)
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_central_rejects_bad_usage_with_exit_2(cli):
    proc = cli("launch", "central", LOCAL, "--device", "tpu9", check=2)
    assert "--device tpu9" in proc.stderr
    proc = cli("launch", "central", LOCAL, "--set", "model.family=surrogate", "--set", "model.ssn.rank=null", check=2)
    assert "model.family" in proc.stderr
