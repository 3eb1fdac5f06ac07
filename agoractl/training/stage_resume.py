"""A worker resuming its stage from the checkpoint store when a run restarts (report §3.3.1.1, §3.7).

Distinct from joining a running stage (:mod:`agoractl.runtime.join`, where the stage's live step
decides): here the stage is not running (no replica publishes progress), so the worker plans from the
store like every other node of the run (:func:`agoractl.ops.resume.plan`: the newest step complete
for every stage, or ``--resume-step``; refusals for another run's store) and loads its stage's
checkpoint at that step: weights, AdamW moments and step counter (the schedule's learning rate
follows the step). The SPARTA round follows from the step too; FGDiLoCo's outer state (round, the
round's start parameters z, the outer momentum) travels in the checkpoint's optimizer state under
``fgdiloco`` (:meth:`agoractl.training.fgdiloco_rounds.FGDiLoCoRounds.outer_state`).

A stage that lost every replica while the other stages went on (its only worker crashed) *rejoins*
instead (:func:`rejoin_stage`): the run's step and sample count come from the other stages (the
replacement steps with them, so the run still reaches ``training.max_steps``), the state from the
store's newest checkpoint of the stage at or before that step (initial weights without one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from agoractl.manifest.schema import Run
from agoractl.ops import resume
from agoractl.ops.checkpoint import Checkpoint, CheckpointStore


@dataclass
class StageResume:
    plan: resume.ResumePlan
    checkpoint: Optional[Checkpoint]

    @property
    def step(self) -> int:
        return self.plan.step

    def facts(self) -> dict[str, Any]:
        """What the worker's stats and the run report say about it."""
        return {"source": "resume" if self.checkpoint is not None else "init", "loaded_step": self.step,
                "stale_steps": 0, "action": self.plan.action, "store": self.plan.store}

    def outer_state(self) -> Optional[dict]:
        """FGDiLoCo's outer state saved with the checkpoint, if any."""
        opt = self.checkpoint.optimizer_state if self.checkpoint is not None else None
        return (opt or {}).get("fgdiloco")

    def apply(self, worker) -> None:
        """Load the checkpoint into a :class:`~agoractl.training.worker.Worker` (module, optimizer,
        CPU masters)."""
        load_into(self.checkpoint, worker)


@dataclass
class StageRejoin:
    """A stage rejoining a running run after losing every replica: at the run's `step` and sample count
    (`seen`), with the store's newest checkpoint of the stage at or before that step, if any."""

    step: int
    seen: int
    checkpoint: Optional[Checkpoint]
    store: str
    action: str = "rejoin"  # "join": a pure pipeline's stage, its last replica's record not expired yet

    @property
    def loaded_step(self) -> int:
        return int(self.checkpoint.meta.get("step", 0)) if self.checkpoint is not None else 0

    def facts(self) -> dict[str, Any]:
        return {"source": "store" if self.checkpoint is not None else "init", "loaded_step": self.loaded_step,
                "stale_steps": self.step - self.loaded_step, "action": self.action, "store": self.store}

    def outer_state(self) -> Optional[dict]:
        """FGDiLoCo's outer state from a checkpoint at the run's step (a run restarting, this worker late);
        None from an older one (the rounds start over at the run's step: its round would be behind)."""
        if self.checkpoint is None or self.loaded_step != self.step:
            return None
        return (self.checkpoint.optimizer_state or {}).get("fgdiloco")

    def apply(self, worker) -> None:
        load_into(self.checkpoint, worker)


@torch.no_grad()
def load_into(checkpoint: Optional[Checkpoint], worker) -> None:
    """Load `checkpoint` (if any) into a :class:`~agoractl.training.worker.Worker` (module, optimizer, CPU
    masters)."""
    if checkpoint is None:
        return
    checkpoint.apply_to(worker.module, worker.optimizer)
    if worker.master is not worker.params:
        for m, p in zip(worker.master, worker.params):
            m.copy_(p.detach().to(m.device))


def resume_stage(run: Run, stage: str, resume_step: Optional[int] = None, fresh: bool = False,
                 force: bool = False) -> StageResume:
    """Plan from ``checkpoints.store`` and load `stage`'s checkpoint at the planned step (none at 0)."""
    store = CheckpointStore(run)
    plan = resume.plan(run, store, resume_step=resume_step, fresh=fresh, force=force)
    checkpoint = store.load(stage, plan.step) if plan.step > 0 else None
    return StageResume(plan, checkpoint)


def rejoin_stage(run: Run, stage: str, step: int, seen: int, action: str = "rejoin") -> StageRejoin:
    """`stage` rejoins the run at `step` with `seen` samples: the store's newest checkpoint of the stage at
    or before `step` is loaded (none: initial weights)."""
    store = CheckpointStore(run)
    steps = [s for s in store.steps(stage) if s <= step]
    checkpoint = store.load(stage, max(steps)) if steps else None
    return StageRejoin(int(step), int(seen), checkpoint, run.checkpoints.store, action)
