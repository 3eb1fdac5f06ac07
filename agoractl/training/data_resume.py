"""A trainer's data position at each checkpoint step, so that a resumed run reads on from there
(report §5.1.0.3; DESIGN §5).

Trainers hold no parameters, so their part of a checkpoint is where their stream stood when the
stages reached the checkpoint's step: the first time every stage's step counter (as the trainer
sees it, from the workers' replies and records) reaches a multiple of ``checkpoints.every_steps``,
the trainer records its stream position (:meth:`agoractl.data.stream.TrainerStream.position`) in
``<data.output>/progress/checkpoints-NNNNN.json`` (beside its consumption reports, written
atomically; the newest ``keep_last + 1`` steps are kept). A resumed trainer opens its stream at the
position of the resume step, so no sequence is trained twice and none is skipped beyond those in
flight when the stages passed the step. The file names the store binding it belongs to (RUN.json's
``bound`` time): positions of a run that was moved aside are never used.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from agoractl import storage
from agoractl.data import remote
from agoractl.data.ledger import PROGRESS_DIR, read_progress
from agoractl.manifest.schema import Run


def positions_url(output: str, trainer: int) -> str:
    return storage.join(output, PROGRESS_DIR, f"checkpoints-{trainer:05d}.json")


class CheckpointPositions:
    """One trainer's stream positions by checkpoint step (`binding`: the store's RUN.json stamp)."""

    def __init__(self, run: Run, trainer: int, binding: Optional[str]):
        self.run, self.trainer, self.binding = run, trainer, binding
        self.every = run.checkpoints.every_steps
        self.url = positions_url(run.data.output, trainer)
        self.positions: dict[str, Any] = {}
        self.same_run = False
        """Whether the file on disk was written under the same store binding (this run's earlier part)."""
        try:
            saved = json.loads(remote.read_bytes(self.url))
            if saved.get("binding") == binding and binding is not None:
                self.same_run = True
                self.positions = dict(saved.get("positions", {}))
        except (FileNotFoundError, ValueError, OSError):
            pass
        self.last = max([0, *map(int, self.positions)])

    def due(self, stage_step: int) -> Optional[int]:
        """The checkpoint step the stages just reached, if this trainer has not recorded it yet."""
        if self.every <= 0:
            return None
        c = (stage_step // self.every) * self.every
        until = self.run.training.until_step
        if until is not None and stage_step >= until:  # the launch's last step is a checkpoint too
            c = max(c, until)
        return c if c > self.last else None

    def record(self, step: int, stream) -> None:
        """Keep `stream`'s position for `step` and rewrite the file (atomically)."""
        self.positions[str(step)] = stream.position()
        self.last = max(self.last, step)
        keep = sorted(self.positions, key=int)[-(self.run.checkpoints.keep_last + 1):]
        self.positions = {k: self.positions[k] for k in keep}
        body = {"trainer": self.trainer, "binding": self.binding, "positions": self.positions}
        remote.write_bytes(self.url, (json.dumps(body) + "\n").encode())

    def position_for(self, step: int, running: bool = False) -> tuple[Optional[dict], str]:
        """(position, source) to resume at checkpoint `step`: the recorded one; else the trainer's last
        consumption report (later than the checkpoint: the sequences between are skipped); else None
        (the ledger's consumption counts). `running`: the stages are already past `step` (a trainer
        restarted in a running swarm): it reads on from its last report instead of going back."""
        if step <= 0 and not running:
            return None, "ledger"
        if str(step) in self.positions and not running:
            return self.positions[str(step)], "checkpoint"
        for report in read_progress(self.run.data.output) if self.same_run else []:
            if report.get("trainer") == self.trainer and report.get("position"):
                return report["position"], "last report"
        return None, "ledger"
