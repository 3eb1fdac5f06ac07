"""The shipped Prometheus rule file passes `promtool check rules` and `promtool test rules` (alerts_test.yml
beside this file), and every rule has a firing and a quiet case there. Needs Debian's `prometheus` package
(promtool); fails, never skips, without it (the README's set-up and .ci/run install it).

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/services/health/test_alert_rules.py -q
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from agoractl.services.health import RULES

HERE = Path(__file__).parent


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install Debian's prometheus package (apt-get install -y prometheus)")
    return path


def test_rule_file_checks_and_its_unit_tests_pass(tmp_path):
    shutil.copy(RULES, tmp_path / "alerts.rules.yml")
    shutil.copy(HERE / "alerts_test.yml", tmp_path / "alerts_test.yml")
    check = subprocess.run([promtool(), "check", "rules", "alerts.rules.yml"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run([promtool(), "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert test.returncode == 0, test.stdout + test.stderr

    rules = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    cases: dict[str, set[bool]] = {}
    for t in yaml.safe_load((HERE / "alerts_test.yml").read_text())["tests"]:
        for case in t.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    assert {name: cases.get(name) for name in rules} == {name: {True, False} for name in rules}
