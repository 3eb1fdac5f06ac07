"""A worker resuming its stage from the checkpoint store when a run restarts (report §3.3.1.1, §3.7).

Distinct from joining a running stage (:mod:`agoractl.runtime.join`, where the stage's live step
decides): here the stage is not running (no replica publishes progress), so the worker plans from the
store like every other node of the run (:func:`agoractl.ops.resume.plan`: the newest step complete
for every stage, or ``--resume-step``; refusals for another run's store) and loads its stage's
checkpoint at that step: weights, AdamW moments and step counter (the schedule's learning rate
follows the step). The SPARTA round follows from the step too; FGDiLoCo's outer state (round, the
round's start parameters z, the outer momentum) travels in the checkpoint's optimizer state under
``fgdiloco`` (:meth:`agoractl.training.fgdiloco_rounds.FGDiLoCoRounds.outer_state`).
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

    @torch.no_grad()
    def apply(self, worker) -> None:
        """Load the checkpoint into a :class:`~agoractl.training.worker.Worker` (module, optimizer,
        CPU masters)."""
        if self.checkpoint is None:
            return
        self.checkpoint.apply_to(worker.module, worker.optimizer)
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
