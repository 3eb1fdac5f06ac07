"""A trainer's data position by checkpoint step (agoractl.training.data_resume): recorded when the stages
reach a checkpoint step, read back by a resumed trainer, whose stream then yields exactly the sequences
an uninterrupted one would have; positions of another binding (a run moved aside) are never used.
Real shards (the session's sample corpus) and ledger files; no network; CPU only."""

from __future__ import annotations

import itertools

import torch

from agoractl.data.stream import report_progress, trainer_stream
from agoractl.manifest.loader import load_manifest
from agoractl.training.data_resume import CheckpointPositions
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
