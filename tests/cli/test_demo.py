"""`agoractl demo`: prints each public command, then runs it, on the embedded default manifest."""

import pytest

from tests.services.health.test_monitoring_swarm import _not_blank


def test_demo_dry_run_lists_steps(cli):
    out = cli("demo", "--dry-run", check=0).stdout
    lines = [l for l in out.splitlines() if l.startswith("$ agoractl ")]
    assert lines[0].startswith("$ agoractl manifest validate") and lines[0].endswith("local-cpu.yaml")


@pytest.mark.swarm  # the demo's own swarm: never beside another one
def test_demo_runs_steps_in_order(cli, tmp_path):
    proc = cli("demo", check=0, timeout=1200)
    out = proc.stdout
    assert out.index("$ agoractl manifest validate") < out.index("$ agoractl manifest plan")
    assert "body-1" in out
    for step in ("$ agoractl launch central", "$ agoractl launch swarm", "$ agoractl checkpoint list",
                 "$ agoractl analyze divergence", "$ agoractl simulate"):
        assert step in out, step
    assert out.index("$ agoractl launch swarm") < out.index("$ agoractl checkpoint list") < \
        out.index("$ agoractl analyze divergence")
    ratio = [l for l in out.splitlines() if l.startswith("swarm/central: ")]
    assert len(ratio) == 1 and " tokens/s = " in ratio[0], out  # printed after the swarm, from the two reports
    assert out.index("$ agoractl launch swarm") < out.index(ratio[0]) < out.index("$ agoractl checkpoint list")
    assert out.rstrip().splitlines()[-1].startswith("dashboard: http://127.0.0.1:8480/ "), out[-500:]  # ends with it
    _not_blank(tmp_path / "runs" / "local-cpu" / "dashboard.png")  # the screenshot of the swarm's Dashboard


def test_ratio_line_reads_both_reports(tmp_path):
    import json

    from agoractl.cli.demo import ratio_line

    assert ratio_line(tmp_path).startswith("swarm/central: no ratio (FileNotFoundError")
    (tmp_path / "central-report.json").write_text(json.dumps({"tokens_per_s": 20000.0}))
    (tmp_path / "swarm-report.json").write_text(json.dumps({"tokens_per_s": 5000.0}))
    assert ratio_line(tmp_path).startswith("swarm/central: 5,000 / 20,000 tokens/s = 0.25 ")
