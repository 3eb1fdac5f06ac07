"""Contributors' pushes through the push gate to a real Prometheus push gateway (Debian's
prometheus-pushgateway on loopback): a push with the run's token (admission off) or a valid worker credential
(admission on) arrives with its four labels; a push without one, or with a forged credential, is refused (401)
and its series never appears at the gateway.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/services/health/test_push_gate.py -q
"""

from __future__ import annotations

import urllib.error

import httpx
import pytest

from agoractl.auth import credential, keys
from agoractl.manifest.schema import Run
from agoractl.runtime.metrics import NodeMetrics
from agoractl.services.authorizer.server import Background
from agoractl.services.health import push_gate
from agoractl.services.health.stack import Stack


@pytest.fixture
def gateway(tmp_path):
    stack = Stack(tmp_path)
    try:
        yield stack.start_pushgateway()
    finally:
        stack.stop()


def _node(run, gate_url, instance):
    run = run.model_copy(update={"monitoring": run.monitoring.model_copy(update={"push_gateway": gate_url})})
    return NodeMetrics(run, "worker", "body-1", instance, lambda: {"agora_samples_total": 3})


def _instances(gateway_url) -> str:
    return httpx.get(gateway_url + "/metrics", timeout=10).text


@pytest.mark.parametrize("admission", [False, True])
def test_only_authenticated_pushes_reach_the_gateway(gateway, admission):
    key = keys.generate()
    run = Run.model_validate({"metadata": {"name": "prun"}, "admission": {
        "enabled": admission, "authority_public_key": keys.public_text(key)}})
    good = credential.issue(key, run="prun", node_id="w1", account="a", role="worker", stage="body-1",
                            peer_id="Qm1", ttl_s=60, serial=1) if admission else "s3cret"
    forged = credential.issue(keys.generate(), run="prun", node_id="w2", account="a", role="worker",
                              stage="body-1", peer_id="Qm2", ttl_s=60, serial=2) if admission else "wrong"
    gate = Background(push_gate.create_app(run, gateway, keys.public_text(key), push_token="s3cret"))
    try:
        _node(run, gate.url, "aaaaaaaaaaaaaaaa").push(good)
        for bad, instance in ((None, "bbbbbbbbbbbbbbbb"), (forged, "cccccccccccccccc")):
            with pytest.raises(urllib.error.HTTPError) as refused:
                _node(run, gate.url, instance).push(bad)
            assert refused.value.code == 401
        text = _instances(gateway)
    finally:
        gate.stop()
    line = next(ln for ln in text.splitlines() if ln.startswith("agora_samples_total{"))
    for label in ('run="prun"', 'role="worker"', 'stage="body-1"', 'instance="aaaaaaaaaaaaaaaa"'):
        assert label in line
    assert "bbbbbbbbbbbbbbbb" not in text and "cccccccccccccccc" not in text
