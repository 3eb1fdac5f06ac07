"""A worker's periodic writes (agoractl.training.replica_writes): replica snapshots from every worker,
stage checkpoints only from the publishing operator, on a real local checkpoint store."""

from __future__ import annotations

from agoractl.manifest.loader import load_manifest
from agoractl.ops.checkpoint import CheckpointStore
from agoractl.training.replica_writes import ReplicaWrites
from agoractl.training.worker import Worker
from tests.conftest import MANIFESTS


def writes(tmp_path, role, publisher):
    run = load_manifest(MANIFESTS / "local-cpu.yaml", [
        "model.seq_len=16", f"checkpoints.store={tmp_path / 'store'}", "checkpoints.every_steps=4",
        "checkpoints.snapshots_every_steps=2", "training.max_steps=10", "training.schedule.warmup_steps=1"])
    w = Worker(run, 0, role=role)
    names = [n for n, p in w.module.named_parameters() if p.requires_grad]
    return ReplicaWrites(run, w, names, f"peer-{role}-{publisher}", publisher=lambda: publisher)


def test_snapshots_from_every_worker_checkpoints_from_the_publisher_only(tmp_path):
    first, second, contributor = (writes(tmp_path, "operator", True), writes(tmp_path, "operator", False),
                                  writes(tmp_path, "contributor", True))
    for w in (first, second, contributor):
        for step in range(1, 5):
            w.on_step(step, "active", {"last_averaged_segment": 0})
        w.shutdown()
    store = CheckpointStore(str(tmp_path / "store"))
    assert store.snapshot_steps("head") == [2, 4]
    assert store.steps("head") == [4]
    assert store.meta("head", 4)["peer"] == "peer-operator-True"
    state = store.load("head")
    names = [n for n, p in first.worker.module.named_parameters() if p.requires_grad]
    assert set(state.model_state) == set(names) and state.optimizer_state is not None


def test_nothing_published_outside_the_active_phase(tmp_path):
    w = writes(tmp_path, "operator", True)
    w.on_step(4, "optimizer_sync")
    w.shutdown()
    assert CheckpointStore(str(tmp_path / "store")).steps("head") == []
