"""End to end: a real local swarm (DHT + 2 workers per stage + trainers, loopback libp2p) trains with
AsyncSPARTA and writes replica snapshots; ``agoractl analyze divergence`` then finds the report's
linear-in-recency pattern (§5.7.2): at every snapshot step, the SPARTA segment averaged most
recently has the lowest inter-replica variance.

Needs ``agoractl launch swarm`` (runtime issue) with SPARTA (SPARTA issue), workers that call
``CheckpointStore.save_snapshot(stage, step, replica, state, meta={"last_averaged_segment": s})``
every ``checkpoints.snapshots_every_steps``, with ``s`` the segment of the last round the replica
applied. Until the swarm command exists the test is skipped with that reason (shown by ``-ra``);
it enables itself once the command is registered. Slow: marked ``swarm``.
"""

from __future__ import annotations

import json

import pytest

from agoractl.ops.checkpoint import CheckpointStore
from tests.conftest import MANIFESTS

FILE = MANIFESTS / "local-cpu.yaml"
SEGMENTS = 4  # sparta.fraction 0.25: few segments, so each is averaged often in a short run
STAGE = "head"


def _swarm_command_exists() -> bool:
    from agoractl.cli.launch import app

    return any((c.name or c.callback.__name__) == "swarm" for c in app.registered_commands)


@pytest.mark.swarm
@pytest.mark.xfail(reason="open line of issue 8: live SPARTA workers do not write replica snapshots yet "
                          "(the issue-5 wiring of SpartaWorker snapshots is unfinished)", strict=False)
def test_most_recently_averaged_segment_has_lowest_variance(cli, tmp_path):
    if not _swarm_command_exists():
        pytest.skip("needs `agoractl launch swarm` with SPARTA and replica snapshots (runtime + SPARTA issues)")
    sets = []
    for s in (f"data.source={tmp_path}/sample/*.parquet", f"data.output={tmp_path}/shards",
              f"checkpoints.store={tmp_path}/store", f"local.run_dir={tmp_path}/run",
              "local.workers_per_stage=2", "data_parallel.method=sparta",
              f"data_parallel.sparta.fraction={1 / SEGMENTS}", "data_parallel.sparta.every_steps=2",
              "checkpoints.snapshots_every_steps=6", "checkpoints.every_steps=0",
              "training.max_steps=24", "training.global_batch_size=4", "training.schedule.warmup_steps=2"):
        sets += ["--set", s]
    cli("data", "sample", "--out", tmp_path / "sample", "--rows", 800, "--files", 2, check=0)
    cli("shard", FILE, *sets, check=0)
    cli("launch", "swarm", FILE, *sets, timeout=600, check=0)
    written = CheckpointStore(str(tmp_path / "store")).snapshot_steps(STAGE)
    assert written, ("the swarm wrote no replica snapshots: every worker must call CheckpointStore.save_snapshot("
                     "stage, step, replica, state, meta={'last_averaged_segment': s}) every "
                     "checkpoints.snapshots_every_steps steps")
    out = json.loads(cli("analyze", "divergence", FILE, "--stage", STAGE, *sets, "--json", check=0).stdout)
    assert out["segments"] == SEGMENTS
    assert out["steps"], "the swarm wrote no replica snapshots"
    checked, wrong = 0, []
    for step in map(str, out["steps"]):
        if len(out["replicas"][step]) < 2:
            continue
        last = out["last_averaged_segment"][step]
        assert last is not None, (f"snapshots at step {step} lack the last_averaged_segment metadata "
                                  "(save_snapshot(..., meta={'last_averaged_segment': s}))")
        variances = out["segment_variance"][step]
        lowest = min(range(SEGMENTS), key=lambda s: variances[s])
        checked += 1
        if lowest != last:
            wrong.append((step, last, lowest, variances))
    assert checked >= 2, f"too few snapshot steps with two replicas: {out['replicas']}"
    assert not wrong, f"(step, last averaged segment, lowest-variance segment, variances): {wrong}"
    # With replicas genuinely apart, the JS distance between them is positive.
    assert all(out["js_max"][s] > 0 for s in map(str, out["steps"]) if len(out["replicas"][s]) >= 2)
