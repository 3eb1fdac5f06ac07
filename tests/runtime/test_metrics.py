"""A node's Prometheus metrics (agoractl.runtime.metrics): served on /metrics with the labels run, role, stage
and instance, registered as a file_sd target, values from the node's counters and events; every exported metric
is in docs/metrics.md's table. In-process, loopback HTTP only.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/runtime/test_metrics.py -q
"""

from __future__ import annotations

import json
import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agoractl.manifest.schema import Run
from agoractl.runtime.metrics import LABELS, METRICS, NodeMetrics
from tests.conftest import ROOT


def test_served_metrics_carry_the_four_labels_and_the_node_values(tmp_path):
    run = Run.model_validate({"metadata": {"name": "mrun"},
                              "monitoring": {"metrics_port": 0, "targets_dir": str(tmp_path / "targets")}})
    m = NodeMetrics(run, "worker", "head", "0123456789abcdef",
                    lambda: {"agora_samples_total": 7, "agora_compute_seconds_total": 1.5,
                             "agora_sync_phase": {(("phase", "active"),): 1, (("phase", "weight_sync"),): 0}})
    m({"event": "round", "status": "complete", "bytes_sent": 100, "bytes_received": 40, "averaging_success": 1.0,
       "reduce_success": 1.0, "matchmaking_s": 0.5, "group_size": 2})
    m({"event": "step", "step": 3, "grad_norm": 2.5})
    url = m.start()
    try:
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(url, timeout=10).text)}
        target = json.loads((tmp_path / "targets" / "0123456789abcdef.json").read_text())
    finally:
        m.stop()
    samples = {(s.name, s.labels.get("phase") or s.labels.get("status")): s for f in families.values()
               for s in f.samples if s.name.startswith("agora_")}
    assert all({k: s.labels[k] for k in LABELS} == {"run": "mrun", "role": "worker", "stage": "head",
                                                    "instance": "0123456789abcdef"} for s in samples.values())
    assert samples[("agora_samples_total", None)].value == 7
    assert samples[("agora_sync_phase", "active")].value == 1
    assert samples[("agora_rounds_total", "complete")].value == 1
    assert samples[("agora_sent_bytes_total", None)].value == 100
    assert samples[("agora_grad_norm", None)].value == 2.5
    assert samples[("agora_ram_bytes", None)].value > 0
    assert target[0]["labels"]["instance"] == "0123456789abcdef" and url.endswith(f"{target[0]['targets'][0]}/metrics")
    assert not (tmp_path / "targets" / "0123456789abcdef.json").exists()  # removed on a clean stop


def test_every_metric_is_in_the_docs_table():
    documented = set(re.findall(r"^\| `(agora_[a-z_]+)` \|", (ROOT / "docs" / "metrics.md").read_text(), re.M))
    assert documented == set(METRICS)


def test_a_restarted_swarm_slot_keeps_its_key_and_instance(tmp_path):
    """`launch swarm` hands each node slot one key file: its restart (name ``<slot>.r1``) gets the same one, so
    its metrics ``instance`` does not change. Real subprocesses reading the environment they were given."""
    import subprocess
    import sys

    from agoractl.auth import node_key
    from agoractl.runtime.swarm import Swarm

    swarm = Swarm(Run.model_validate({"local": {"run_dir": str(tmp_path)}}), ROOT / "manifests" / "local-cpu.yaml", [])
    (swarm.dir / "logs").mkdir(parents=True)
    show = [sys.executable, "-c", "import os; print(os.environ['AGORA_NODE_KEY'])"]
    paths = []
    for name in ("worker-body-1-0", "worker-body-1-0.r1", "worker-tail-0"):
        n = swarm._spawn(name, "worker", show, stdout=subprocess.PIPE)
        paths.append(n.proc.communicate(timeout=60)[0].decode().strip())
    assert paths[0] == paths[1] != paths[2]
    first = node_key.instance_id(node_key.load_or_create(paths[0]))
    assert node_key.instance_id(node_key.load_or_create(paths[1])) == first
