"""Tests of the manifest's ``local.hosts`` section (agoractl.manifest.hosts): rules, matching and the errors a
user sees. In-memory."""

import pytest

from agoractl.manifest.loader import ManifestError, load_manifest
from tests.conftest import MANIFESTS

MANIFEST = MANIFESTS / "local-cpu.yaml"


def test_default_is_off_and_unshaped():
    hosts = load_manifest(MANIFEST).local.hosts
    assert not hosts.enabled and hosts.shaping == [] and hosts.shape_for("worker", "contributor", "head") is None


def test_first_matching_rule_applies():
    run = load_manifest(MANIFEST, ["local.workers_per_stage=3", "local.hosts.contributors_per_stage=1",
                                   "local.hosts.shaping=[{kind: worker, role: contributor, stage: tail, "
                                   "bandwidth_mbps: 50, rtt_ms: 100}, {kind: worker, role: contributor, "
                                   "bandwidth_mbps: 200, rtt_ms: 80}]"])
    hosts = run.local.hosts
    assert hosts.shape_for("worker", "contributor", "tail").bandwidth_mbps == 50
    assert hosts.shape_for("worker", "contributor", "head").rtt_ms == 80
    assert hosts.shape_for("worker", "operator", "head") is None  # §3.5.2.2: only contributors are shaped
    assert hosts.shape_for("trainer") is None


@pytest.mark.parametrize("sets, where", [
    (["local.hosts.shaping=[{stage: nowhere, rtt_ms: 10}]"], "local.hosts.shaping[0].stage"),
    (["local.hosts.contributors_per_stage=1"], "local.hosts.contributors_per_stage"),  # 1 worker per stage
    (["local.hosts.subnet=10.77.0.0/28"], "local.hosts.subnet"),
    (["local.hosts.shaping=[{bandwidth_mbps: 0}]"], "local.hosts.shaping.0.bandwidth_mbps"),
])
def test_bad_hosts_sections_are_refused(sets, where):
    with pytest.raises(ManifestError) as e:
        load_manifest(MANIFEST, sets)
    assert where.split(".")[-1] in str(e.value) or where in str(e.value)
