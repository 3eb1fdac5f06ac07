"""Sync phases of a joining worker (agoractl.algorithms.sync_phases): in-memory, no network."""

from agoractl.manifest.schema import Join
from agoractl.algorithms.sync_phases import SyncPhases, initial_phase


def test_fresh_state_goes_active_stale_state_syncs():
    join = Join(max_stale_steps=5, weight_sync_steps=4, optimizer_sync_steps=2)
    assert initial_phase(5, join) == "active"
    assert initial_phase(6, join) == "weight_sync"
    assert initial_phase(6, Join(max_stale_steps=5, weight_sync_steps=0, optimizer_sync_steps=2)) == "optimizer_sync"
    assert initial_phase(6, Join(max_stale_steps=5, weight_sync_steps=0, optimizer_sync_steps=0)) == "active"


def test_weight_sync_then_optimizer_sync_then_active():
    p = SyncPhases(Join(max_stale_steps=0, weight_sync_steps=3, optimizer_sync_steps=2), stale_steps=20, step=20)
    seen = []
    for step in range(21, 30):
        seen.append((step, p.phase, p.visible, p.counts_samples, p.averaging_weight(8)))
        p.on_step(step)
    # Weight sync: invisible, weight 0; optimizer sync: visible, weight 0, no samples; then all.
    assert seen[0][1:] == ("weight_sync", False, False, 0.0)
    assert seen[3][1:] == ("optimizer_sync", True, False, 0.0)
    assert seen[5][1:] == ("active", True, True, 8.0)
    assert p.history == [("weight_sync", 20), ("optimizer_sync", 23), ("active", 25)]


def test_active_worker_never_changes():
    p = SyncPhases(Join(), stale_steps=0)
    assert all(p.on_step(s) is None for s in range(1, 50)) and p.phase == "active"


def test_a_syncing_worker_alone_in_its_stage_goes_active():
    # Its stage's serving replicas are gone: nothing to catch up with, and the stage must keep stepping.
    join = Join(max_stale_steps=0, weight_sync_steps=3, optimizer_sync_steps=2)
    p = SyncPhases(join, stale_steps=20, step=20)
    assert p.alone(20) == "active" and p.visible and p.counts_samples and p.averaging_weight(8) == 8.0
    assert p.alone(21) is None and p.history == [("weight_sync", 20), ("active", 20)]
    q = SyncPhases(join, stale_steps=20, step=20)
    for step in range(21, 24):
        q.on_step(step)
    assert q.phase == "optimizer_sync" and q.alone(24) == "active"
    assert q.history == [("weight_sync", 20), ("optimizer_sync", 23), ("active", 24)]
