"""A trainer's data position by checkpoint step (agoractl.training.data_resume): recorded when the stages
reach a checkpoint step, read back by a resumed trainer, whose stream then yields exactly the sequences
an uninterrupted one would have (from before the first sample counted toward the checkpoint's step, so
those in flight are read again); positions of another binding (a run moved aside) are never used.
Real shards (the session's sample corpus) and ledger files; no network; CPU only."""

from __future__ import annotations

import itertools

import torch

from agoractl.data.stream import report_progress, trainer_stream
from agoractl.manifest.loader import load_manifest
from agoractl.training.data_resume import CheckpointPositions, DrawLog
from tests.conftest import MANIFESTS, private_shards


def test_recorded_position_resumes_the_stream_exactly(tmp_path, sample_shards):
    run = load_manifest(MANIFESTS / "local-cpu.yaml", [*private_shards(sample_shards, tmp_path), "model.seq_len=32",
                                                       "trainers.count=1", "checkpoints.every_steps=4"])
    stream = trainer_stream(run, 0)
    positions = CheckpointPositions(run, 0, binding="b1")
    assert positions.due(3) is None and positions.due(5) == 4
    before = list(itertools.islice(stream, 7))
    positions.record(4, stream)
    assert positions.due(5) is None and positions.due(8) == 8
    after = list(itertools.islice(stream, 5))

    again = CheckpointPositions(run, 0, binding="b1")
    position, source = again.position_for(4)
    assert source == "checkpoint"
    resumed = list(itertools.islice(trainer_stream(run, 0, position), 5))
    assert all(torch.equal(a, b) for a, b in zip(resumed, after))
    assert not any(torch.equal(r, b) for r in resumed for b in before)

    report_progress(run, 0, stream)  # a trainer restarted while the stages are past step 4 reads on
    assert again.position_for(4, running=True) == (stream.position(), "last report")

    other = CheckpointPositions(run, 0, binding="b2")  # the store was rebound: a new run
    assert other.position_for(4) == (None, "ledger") and other.due(4) == 4


def test_the_launchs_until_step_is_a_checkpoint_step_too(tmp_path, sample_shards):
    """A launch that stops after training.until_step records the data position there, even off the
    checkpoints.every_steps grid, so that the next launch resumes from it."""
    run = load_manifest(MANIFESTS / "local-cpu.yaml", [*private_shards(sample_shards, tmp_path), "trainers.count=1",
                                                       "checkpoints.every_steps=4", "training.until_step=6"])
    positions = CheckpointPositions(run, 0, binding="b1")
    assert positions.due(5) == 4 and positions.due(6) == 6
    positions.last = 6
    assert positions.due(6) is None


def test_the_recorded_position_is_before_the_first_sample_counted_toward_the_checkpoint():
    """The samples the tail counted toward the checkpoint's step or later are not in the checkpoint: a
    resumed run reads them again, unless a later draw counted toward an earlier step (pipelines
    overtook each other), where the current position skips those in flight (never trained twice)."""
    log = DrawLog()
    draws = [log.drawn({"at": i}) for i in range(6)]
    for n, step in zip(draws, [3, 3, 4, 4]):
        log.counted(n, step)
    assert log.position_at(4, {"at": "now"}) == {"at": 2}  # draws 4 and 5 are in flight
    assert log.position_at(4, {"at": "now"}) == {"at": 2}  # the draws before it are forgotten, not it
    log.counted(draws[5], 3)  # counted toward 3 after draw 2 was counted toward 4
    assert log.position_at(4, {"at": "now"}) == {"at": "now"}
    for n in draws[2:]:
        log.counted(n, 4)
    assert log.position_at(5, {"at": "now"}) == {"at": "now"}  # everything drawn counted before step 5
