"""FGDiLoCo wired into a worker process (seed 002; report §4.2): the outer rounds over the real transport.

The outer rounds (inner steps, Mix1 in the background, Mix2 blocking, the replica's outer step) are
:class:`~agoractl.training.fgdiloco_rounds.FGDiLoCoRounds`; this module hands them what only a
networked node has: the stage's averaging transport (:class:`~agoractl.runtime.averaging.StageAverager`,
built by the worker node from ``data_parallel.fgdiloco`` and injected; the same transport SPARTA runs
on), the stage's live peers read from the DHT, joining from a live peer or the checkpoint store
(:mod:`agoractl.runtime.join`), and periodic snapshots
(:class:`~agoractl.training.replica_writes.ReplicaWrites`).
"""

from __future__ import annotations

from typing import Any

from agoractl.manifest.schema import Run
from agoractl.runtime.averaging import StageAverager
from agoractl.runtime.join import join_stage, serve_state
from agoractl.runtime.stage_peers import StagePeers
from agoractl.training.fgdiloco_rounds import FGDiLoCoRounds, TransportMixing
from agoractl.training.replica_writes import ReplicaWrites


class FGDiLoCoNode:
    """The FGDiLoCo side of one worker (a :class:`~agoractl.training.data_parallel.DataParallelMethod`).
    Create after the Worker, then :meth:`join`, :meth:`start`; :meth:`shutdown` on exit."""

    def __init__(self, run: Run, worker, averager: StageAverager, records, peer: str):
        self.run, self.worker, self.averager = run, worker, averager
        self.names = [n for n, p in worker.module.named_parameters() if p.requires_grad]
        self.averager.state_provider = serve_state(worker)
        self.peers = StagePeers(records, worker.name, peer, run.workers.announce_period_s)
        mixing = TransportMixing(averager, self.peers.live_now)
        self.rounds = FGDiLoCoRounds(run, worker, mixing, averager.round_deadline_s)
        self.writes = ReplicaWrites(run, worker, self.names, peer, publisher=self.peers.first_operator,
                                    extra_state=lambda: {"fgdiloco": self.rounds.outer_state()})
        worker.step_callbacks.append(lambda step, w: self.writes.on_step(step + 1, w.phase))
        self.join_facts: dict[str, Any] = {"source": "init", "loaded_step": 0}

    def join(self, stage_step: int) -> dict[str, Any]:
        """A worker joining a stage that already trained loads its state (a live peer, else the store)."""
        source, loaded = join_stage(self.run, self.worker, self.averager, stage_step)
        self.join_facts = {"source": source, "loaded_step": loaded}
        return self.join_facts

    def start(self) -> None:
        self.peers.start()
        self.rounds.start(self.worker.progress.step)

    def summary(self) -> dict[str, Any]:
        return {**self.rounds.summary(), "join": self.join_facts}

    def shutdown(self) -> None:
        self.writes.shutdown()
        self.peers.stop()
        try:
            self.averager.shutdown()
        except Exception:
            pass
