"""A worker's periodic writes to the checkpoint store (report §3.3.1.1, §5.7.2; DESIGN §5).

Every ``checkpoints.snapshots_every_steps`` stage steps every worker writes a replica snapshot of
its master weights (for ``agoractl analyze divergence``); every ``checkpoints.every_steps`` (and at
``training.until_step``, where the launch stops) an active operator publishes the stage checkpoint
(weights and optimizer state) that joining workers load; with several operators only one publishes
(``publisher``, e.g. the stage's first operator), since replicas writing the same step at once would
interleave their files. The state is copied on the compute thread, between optimizer steps, and written by one
background thread, so storage never stalls training; a failed write is logged, never fatal.
Shared by the SPARTA and FGDiLoCo sides of a worker.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from agoractl import logs
from agoractl.manifest.schema import Run
from agoractl.ops.checkpoint import CheckpointStore, due


class ReplicaWrites:
    """Snapshots and operator checkpoints of one worker (`names` order its master tensors)."""

    def __init__(self, run: Run, worker, names: list[str], peer: str,
                 publisher: Callable[[], bool] = lambda: True,
                 extra_state: Optional[Callable[[], dict]] = None):
        c = run.checkpoints
        self.run, self.worker, self.names, self.peer = run, worker, names, peer
        self.publisher = publisher
        self.extra_state = extra_state
        """More state for the checkpoint's optimizer file (e.g. FGDiLoCo's outer loop), merged at its top level."""
        self.store = CheckpointStore(run) if (c.snapshots_every_steps or c.every_steps) else None
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-io")
        self.log = logs.get("replica-writes")

    def _state(self) -> dict:
        return {n: t.detach().clone() for n, t in zip(self.names, self.worker.master)}

    def on_step(self, step: int, phase: str, meta: Optional[dict[str, Any]] = None) -> None:
        """After the stage's step `step`: write what is due (`meta` goes into the snapshot's metadata)."""
        c = self.run.checkpoints
        if self.store is None:
            return
        if due(step, c.snapshots_every_steps):
            info = {"phase": phase, "role": self.worker.role, **(meta or {})}
            self.io.submit(self._write, "snapshot", self.store.save_snapshot, self.worker.name, step, self.peer,
                           self._state(), info)
        last = step == self.run.training.until_step and c.every_steps > 0  # the launch stops there: resume from it
        if self.worker.role == "operator" and phase == "active" and (due(step, c.every_steps) or last) \
                and self.publisher():
            opt = copy.deepcopy(self.worker.optimizer.state_dict())
            if self.extra_state is not None:
                opt.update(self.extra_state())
            self.io.submit(self._write, "checkpoint", self.store.publish, self.worker.name, step, self._state(), opt,
                           {"peer": self.peer})

    def _write(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # storage trouble must not kill training; it is logged
            self.log.warning(f"{what} not written", error=f"{type(e).__name__}: {e}")

    def shutdown(self) -> None:
        """Finish the writes already queued."""
        self.io.shutdown(wait=True)
