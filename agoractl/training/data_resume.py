"""A trainer's data position at each checkpoint step, so that a resumed run reads on from there
(report §5.1.0.3; DESIGN §5).

Trainers hold no parameters, so their part of a checkpoint is where their stream stood when the
stages reached the checkpoint's step: the first time every stage's step counter (as the trainer
sees it, from the workers' replies and records) reaches a multiple of ``checkpoints.every_steps``,
the trainer records its stream position (:meth:`agoractl.data.stream.TrainerStream.position`) in
``<data.output>/progress/checkpoints-NNNNN.json`` (beside its consumption reports, written
atomically; the newest ``keep_last + 1`` steps are kept). A resumed trainer opens its stream at the
position of the resume step, so no sequence is trained twice and none is skipped beyond those in
flight when the stages passed the step. The position recorded is the one before the first sample the
tail counted toward the checkpoint's step or later (:class:`DrawLog`; such samples are not in the
checkpoint), so that the resumed run reads them again as an uninterrupted one trains them; when a later
drawn sample counted toward an earlier step (pipelines overtaking each other), it is the stream's current
position, skipping the samples in flight. The file names the store binding it belongs to (RUN.json's
``bound`` time): positions of a run that was moved aside are never used.
"""

from __future__ import annotations

import json
import threading
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

    def record(self, step: int, stream, draws: Optional["DrawLog"] = None) -> None:
        """Keep the position for `step` (`stream`'s, or the one `draws` knows to be exact) and rewrite the
        file (atomically)."""
        self.positions[str(step)] = draws.position_at(step, stream.position()) if draws else stream.position()
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


class DrawLog:
    """The stream position before each microbatch a trainer drew, and the step the tail counted it toward
    (None while it has not reached the tail: it will count toward the tail's current step or later, or be
    lost). Thread-safe: samples are drawn on the trainer's data thread, tail replies come on its loop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = 0
        self._entries: dict[int, list] = {}  # draw number -> [position before it, tail step or None]

    def drawn(self, position: dict) -> int:
        """A microbatch is about to be drawn from `position`: its draw number."""
        with self._lock:
            n, self._next = self._next, self._next + 1
            self._entries[n] = [position, None]
            return n

    def counted(self, n: int, step: int) -> None:
        """The tail counted draw `n` toward `step`."""
        with self._lock:
            if n in self._entries:
                self._entries[n][1] = step

    def position_at(self, step: int, current: dict) -> dict:
        """Where a run resumed at checkpoint `step` reads on: before the first draw not counted toward an
        earlier step (when none drawn after it was), else `current`. Forgets the draws before that point."""
        with self._lock:
            later = [n for n, (_, s) in self._entries.items() if s is None or s >= step]
            if not later:
                self._entries.clear()
                return current
            first = min(later)
            exact = not any(s is not None and s < step for n, (_, s) in self._entries.items() if n > first)
            position = self._entries[first][0] if exact else current
            self._entries = {n: e for n, e in self._entries.items() if n >= first}
            return position
