"""benchmarks/worker_inprocess.py: every stage's worker in one process, fed a swarm step's requests — each
stage steps once per batch, every request is one compute batch, and the backwards are served from the
activation cache as in the swarm."""

from __future__ import annotations

from tests.benchmarks import load_benchmark
from tests.conftest import ROOT


def test_it_feeds_each_stage_a_steps_requests_and_counts_their_compute():
    bench = load_benchmark("worker_inprocess")
    r = bench.measure(str(ROOT / "manifests/local-cpu.yaml"), ["trainers.microbatch=4"], steps=1)
    requests = 2 * 16 // 4  # the warm-up step and the measured one, 16 samples each, 4 per request
    assert r["steps_taken"] == [2, 2, 2] and r["samples"] == 16 and r["request_samples"] == 4
    assert r["batches"]["head"] == {"forward": requests, "backward": requests}
    assert r["batches"]["body-1"] == {"forward": requests, "backward": requests}
    assert r["batches"]["tail"] == {"forward_backward": requests}
    for stage in ("head", "body-1"):
        assert r["cache"][stage]["hits"] == requests and r["cache"][stage]["misses"] == 0
    per_stage = r["stage_compute_cpu_ms_per_sample"]
    assert set(per_stage) == {"head", "body-1", "tail"} and all(v > 0 for v in per_stage.values())
    assert abs(r["compute_cpu_ms_per_sample"] - sum(per_stage.values())) < 0.05
    assert r["cpu_ms_per_sample"] >= r["compute_cpu_ms_per_sample"] and r["threads"] == 1
