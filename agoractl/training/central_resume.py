"""Checkpoints of the centralized reference (``launch central``), and resuming it bit for bit.

The whole model (its full ``state_dict``) and the AdamW state go to ``<checkpoints.store>/central/``
as the one stage ``model`` (:func:`agoractl.ops.resume.central_store`), every
``checkpoints.every_steps`` steps and after the last step. The store is planned like a swarm's
(:func:`agoractl.ops.resume.plan`: bound to the run, refused when it holds another run's). A resumed
run loads weights and moments, takes the schedule's learning rate at the checkpoint's step, and
skips the ``step x global_batch_size`` samples the run's deterministic stream
(:func:`agoractl.data.stream.run_sequences`) yielded before it, so N steps then N more equal 2N
steps exactly (when both parts use the same ``training.max_steps``: the cosine schedule depends on it).
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional

from agoractl.manifest.schema import Run
from agoractl.ops import resume
from agoractl.ops.checkpoint import Checkpoint


class CentralCheckpoints:
    """The plan for one ``launch central``, and its checkpoint writes."""

    def __init__(self, run: Run, resume_step: Optional[int] = None, fresh: bool = False, force: bool = False):
        self.run = run
        self.enabled = run.checkpoints.every_steps > 0
        self.store = resume.central_store(run)
        self.plan = resume.plan(run, self.store, [resume.CENTRAL_STAGE], resume_step, fresh, force,
                                apply=self.enabled or fresh)

    def load(self) -> Optional[Checkpoint]:
        """The checkpoint to continue from, or None when starting at step 0."""
        if self.plan.step == 0:
            return None
        return self.store.load(resume.CENTRAL_STAGE, self.plan.step)

    def skip(self, samples: Iterator) -> Iterator:
        """`samples` after the ones the resumed steps consumed."""
        n = self.plan.step * self.run.training.global_batch_size
        return itertools.islice(samples, n, None) if n else samples

    def save(self, step: int, model, optimizer) -> None:
        self.store.publish(resume.CENTRAL_STAGE, step, model.state_dict(), optimizer.state_dict(),
                           {"mode": "central", "samples": step * self.run.training.global_batch_size,
                            "max_steps": self.run.training.max_steps, "run": self.plan.identity})
