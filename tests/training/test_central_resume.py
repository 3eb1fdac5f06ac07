"""The centralized reference resumes bit for bit: 2N steps in one go equal N steps (``--until-step``
style) then N more resumed from the checkpoint store, weights and loss at every step. In-process,
on the session's real sample shards and a real local store; CPU only."""

from __future__ import annotations

import torch

from agoractl.data.stream import run_sequences
from agoractl.manifest.loader import load_manifest
from agoractl.training.central import train_central
from agoractl.training.central_resume import CentralCheckpoints
from tests.conftest import MANIFESTS, private_shards

N = 4


def _run(tmp_path, sample_shards, store: str):
    data = private_shards(sample_shards, tmp_path / store) if not (tmp_path / store / "shards").exists() else [
        f"data.source={sample_shards / 'sample'}/*.parquet", f"data.output={tmp_path / store / 'shards'}",
        "data.num_shards=4"]
    return load_manifest(MANIFESTS / "local-cpu.yaml", [
        *data, "model.seq_len=32", "training.global_batch_size=4", "workers.max_microbatch=4", "trainers.microbatch=1",
        f"training.max_steps={2 * N}", "training.schedule.warmup_steps=2", f"checkpoints.every_steps={N}",
        f"checkpoints.store={tmp_path / store / 'store'}"])


def _train(run, until=None):
    torch.manual_seed(0)
    ckpt = CentralCheckpoints(run)
    holder = {}

    def save(step, model, optimizer):
        ckpt.save(step, model, optimizer)
        holder["state"] = {k: v.clone() for k, v in model.state_dict().items()}

    report = train_central(run, ckpt.skip(run_sequences(run)), "cpu", resume=ckpt.load(), until=until,
                           on_checkpoint=save)
    return report, holder["state"], ckpt.plan


def test_n_steps_then_n_resumed_equal_2n_steps_bit_for_bit(tmp_path, sample_shards):
    whole = _run(tmp_path, sample_shards, "whole")
    ref, ref_state, _ = _train(whole)
    assert ref["steps"] == 2 * N and ref["completed"]

    parts = _run(tmp_path, sample_shards, "parts")
    first, _, plan1 = _train(parts, until=N)
    assert plan1.action == "new" and first["end_step"] == N
    second, state, plan2 = _train(parts)
    assert plan2.action == "resume" and plan2.step == N and second["start_step"] == N
    assert first["loss"] + second["loss"] == ref["loss"]  # every step's loss, exactly
    assert state.keys() == ref_state.keys()
    assert all(torch.equal(state[k], ref_state[k]) for k in state)
