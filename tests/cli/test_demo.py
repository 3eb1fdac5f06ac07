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
    assert out.rstrip().splitlines()[-1].startswith("dashboard: http://127.0.0.1:8480/ "), out[-500:]  # ends with it
    _not_blank(tmp_path / "runs" / "local-cpu" / "dashboard.png")  # the screenshot of the swarm's Dashboard
