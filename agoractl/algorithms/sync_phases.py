"""Sync phases of a joining worker (report §3.3.1.1, §5.6): weight sync, optimizer sync, then active.

A worker whose loaded state is more than ``join.max_stale_steps`` behind its stage would drag the
stage's average backward, so it catches up first:

- **weight sync** (``join.weight_sync_steps`` stage steps): invisible to trainers (no batches), it
  takes part in every averaging round with weight 0, absorbing the consensus without mixing in its
  stale weights (``weight_sync_steps = 400`` is a full SPARTA pass at 5% every 20 steps);
- **optimizer sync** (``join.optimizer_sync_steps``): visible, it trains on real batches to warm
  its AdamW moments, but still averages with weight 0 and reports no samples toward the stage's
  batch target (100 steps: five time constants of beta2 = 0.95);
- **active**: full participation.

A worker in a sync phase whose stage has no serving replica left (the ones it was catching up with
died or left) goes active at once (:meth:`SyncPhases.alone`): there is no consensus to absorb, and a
stage whose only replicas are invisible or report no samples would never take another step.

Pure: counts the stage steps the worker lives through; the worker asks it what it may do.
"""

from __future__ import annotations

from typing import Optional

from agoractl.manifest.schema import Join

PHASES = ("weight_sync", "optimizer_sync", "active")


def initial_phase(stale_steps: int, join: Join) -> str:
    """The phase a worker starts in, `stale_steps` behind its stage."""
    if stale_steps <= join.max_stale_steps:
        return "active"
    if join.weight_sync_steps > 0:
        return "weight_sync"
    return "optimizer_sync" if join.optimizer_sync_steps > 0 else "active"


class SyncPhases:
    """The phase of one worker and when it moves on; `history` lists (phase, stage step entered)."""

    def __init__(self, join: Join, stale_steps: int, step: int = 0):
        self.join = join
        self.phase = initial_phase(stale_steps, join)
        self.steps_in_phase = 0
        self.history: list[tuple[str, int]] = [(self.phase, int(step))]

    @property
    def visible(self) -> bool:
        """Trainers may route batches to it (not in weight sync)."""
        return self.phase != "weight_sync"

    @property
    def counts_samples(self) -> bool:
        """Its samples count toward the stage's batch target (only once active)."""
        return self.phase == "active"

    def averaging_weight(self, samples: float) -> float:
        """Its weight in an averaging round: the samples since the last round once active, else 0."""
        return float(samples) if self.phase == "active" else 0.0

    def _limit(self) -> int:
        return self.join.weight_sync_steps if self.phase == "weight_sync" else self.join.optimizer_sync_steps

    def on_step(self, step: int) -> Optional[str]:
        """The stage took a step (`step` is the new stage step); returns the new phase on a change."""
        if self.phase == "active":
            return None
        self.steps_in_phase += 1
        changed = None
        while self.phase != "active" and self.steps_in_phase >= self._limit():
            self.phase = "optimizer_sync" if self.phase == "weight_sync" else "active"
            self.steps_in_phase = 0
            changed = self.phase
            if self.phase == "optimizer_sync" and self.join.optimizer_sync_steps > 0:
                break
        if changed is not None:
            self.history.append((self.phase, int(step)))
        return changed

    def alone(self, step: int) -> Optional[str]:
        """No other replica of the stage serves (none to catch up with, and without this one the stage
        takes no step): a worker in a sync phase goes active; returns ``"active"`` on a change."""
        if self.phase == "active":
            return None
        self.phase, self.steps_in_phase = "active", 0
        self.history.append((self.phase, int(step)))
        return self.phase
