"""Checkpoints of a worker without data-parallel averaging (``data_parallel.method: none``).

SPARTA and FGDiLoCo workers write snapshots and stage checkpoints through their own
:class:`~agoractl.training.replica_writes.ReplicaWrites`; a pure pipeline needs the checkpoints too, or
the run could not resume from its store. One replica per stage publishes: the one whose peer id is
the smallest among the replicas publishing progress that ran a fair share of the stage's samples
(:func:`~agoractl.algorithms.progress.checkpoint_publisher`; the node's DHT thread keeps
``worker.progress`` current), so no DHT call is added. Stands in for the data-parallel side
of the worker node (``join``, ``start``, ``summary``, ``shutdown``).
"""

from __future__ import annotations

from typing import Any

from agoractl.algorithms.progress import checkpoint_publisher
from agoractl.manifest.schema import Run
from agoractl.training.replica_writes import ReplicaWrites


class PipelineWrites:
    def __init__(self, run: Run, worker, peer: str):
        self.worker, self.peer = worker, peer
        names = [n for n, p in worker.module.named_parameters() if p.requires_grad]
        self.writes = ReplicaWrites(run, worker, names, peer, publisher=self.first)
        worker.step_callbacks.append(lambda step, w: self.writes.on_step(step + 1, w.phase))
        self.join_facts: dict[str, Any] = {"source": "init", "loaded_step": 0}

    def first(self) -> bool:
        """Whether this replica publishes (:func:`~agoractl.algorithms.progress.checkpoint_publisher`)."""
        return checkpoint_publisher(self.worker.progress.contributions(self.peer)) == self.peer

    def join(self, stage_step: int) -> None:
        """A joiner of a pure pipeline keeps its initial weights (nothing averages them toward the stage)."""

    def start(self) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {"join": self.join_facts}

    def shutdown(self) -> None:
        self.writes.shutdown()
