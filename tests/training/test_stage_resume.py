"""A worker's stage state through a real local checkpoint store and back (agoractl.training.stage_resume):
weights, AdamW moments, the step, and FGDiLoCo's outer state (round, z, momentum) restored mid-round.
In-process, real :class:`Worker` replicas, no network; CPU only."""

from __future__ import annotations

import copy

import torch

from agoractl.manifest.loader import load_manifest
from agoractl.ops import resume
from agoractl.ops.checkpoint import CheckpointStore
from agoractl.training.fgdiloco_rounds import FGDiLoCoRounds, Unmixed
from agoractl.training.stage_resume import rejoin_stage, resume_stage
from agoractl.training.worker import Worker
from tests.conftest import MANIFESTS


class Alone:
    def start(self, kind, index, values):
        return Unmixed(values, {"round": index, "status": "skipped", "kind": kind})


def test_stage_state_and_fgdiloco_outer_state_resume_exactly(tmp_path):
    run = load_manifest(MANIFESTS / "fgdiloco-local-cpu.yaml", [
        f"checkpoints.store={tmp_path / 'store'}", "training.max_steps=40", "data_parallel.fgdiloco.inner_steps=4"])
    w = Worker(run, 0)
    fg = FGDiLoCoRounds(run, w, Alone())
    fg.begin(2)  # round 2 started at step 8; the checkpoint falls mid-round, at step 10
    with torch.no_grad():
        for p in w.master:
            p.add_(0.01)
            p.grad = torch.full_like(p, 0.1)
    w.optimizer.step()
    fg.outer.buffer = torch.linspace(0, 1, fg.z.numel())
    opt = {**copy.deepcopy(w.optimizer.state_dict()), "fgdiloco": fg.outer_state()}
    state = {n: t.detach().clone() for n, t in w.module.named_parameters()}
    store = CheckpointStore(run)
    assert resume.plan(run).action == "new"  # the first launch binds the store to the run
    for i, stage in enumerate(run.stage_names()):  # every stage has step 10: the plan's common step
        store.publish(stage, 10, state if i == 0 else Worker(run, i).module.state_dict(), opt if i == 0 else None)

    resumed = resume_stage(run, w.name)
    assert resumed.plan.action == "resume" and resumed.step == 10
    w2 = Worker(run, 0, step=resumed.step)
    resumed.apply(w2)
    assert all(torch.equal(a, b) for a, b in zip(w.master, w2.master))
    moments = w.optimizer.state_dict()["state"]
    assert all(torch.equal(moments[k]["exp_avg"], v["exp_avg"]) for k, v in w2.optimizer.state_dict()["state"].items())
    fg2 = FGDiLoCoRounds(run, w2, Alone())
    fg2.restore(resumed.outer_state(), resumed.step)
    fg2.start(resumed.step)  # mid-round: the restored round goes on, no new one begins
    assert fg2.round == 2 and torch.equal(fg2.z, fg.z) and torch.equal(fg2.outer.buffer, fg.outer.buffer)
    assert torch.equal(fg2.mix1.result()[0], fg.z)
    assert resumed.facts()["source"] == "resume" and resumed.facts()["loaded_step"] == 10


def test_a_stage_rejoins_at_the_runs_step_from_its_newest_checkpoint_before_it(tmp_path):
    """The only tail worker died; the head is 3 samples into step 13. The tail's replacement loads the tail's
    newest checkpoint at or before step 13 (10, of 5, 10 and 15), starts at step 13 and counts the head's
    samples; with no checkpoint at or before the step, initial weights."""
    run = load_manifest(MANIFESTS / "local-cpu.yaml", [f"checkpoints.store={tmp_path / 'store'}",
                                                       "training.max_steps=40"])
    tail, batch = run.stage_names()[-1], run.training.global_batch_size
    store = CheckpointStore(run)
    assert rejoin_stage(run, tail, 13, 13 * batch + 3).facts() == {
        "source": "init", "loaded_step": 0, "stale_steps": 13, "action": "rejoin", "store": str(tmp_path / "store")}
    trained = Worker(run, len(run.stage_names()) - 1)
    with torch.no_grad():
        for p in trained.master:
            p.add_(0.5)
    for step in (5, 10, 15):
        store.publish(tail, step, trained.module.state_dict(), trained.optimizer.state_dict())
    rejoined = rejoin_stage(run, tail, 13, 13 * batch + 3)
    assert rejoined.facts() | {"store": None} == {
        "source": "store", "loaded_step": 10, "stale_steps": 3, "action": "rejoin", "store": None}
    assert rejoined.outer_state() is None  # an older checkpoint's round is behind the run
    w = Worker(run, len(run.stage_names()) - 1, step=rejoined.step, seen=rejoined.seen)
    rejoined.apply(w)
    assert all(torch.equal(a, b) for a, b in zip(w.master, trained.master))
    assert w.progress.step == 13 and w.progress.room() == batch - 3
