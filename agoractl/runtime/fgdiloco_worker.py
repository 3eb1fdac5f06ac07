"""FGDiLoCo wired into a worker process (seed 002; report §4.2): the outer rounds over the real transport.

The outer rounds (inner steps, Mix1 in the background, Mix2 blocking, the replica's outer step) are
:class:`~agoractl.training.fgdiloco_rounds.FGDiLoCoRounds`; this module hands them what only a
networked node has: the stage's mixing transport, the stage's live peers read from the DHT, joining from a
live peer or the checkpoint store (:mod:`agoractl.runtime.join`), and periodic snapshots
(:class:`~agoractl.training.replica_writes.ReplicaWrites`). The transport is ``data_parallel.fgdiloco.transport``:

- ``direct`` (:class:`~agoractl.runtime.direct_mixing.DirectMixing`): the replicas push their values to each
  other over libp2p, no matchmaking; it also serves the stage state to joining workers, so no averager
  process runs;
- ``hivemind``: the stage's averaging transport (:class:`~agoractl.runtime.averaging.StageAverager`, built by
  the worker node from ``data_parallel.fgdiloco`` and injected; the same transport SPARTA runs on), through
  :class:`~agoractl.training.fgdiloco_rounds.TransportMixing`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from agoractl.manifest.schema import Run
from agoractl.runtime.averaging import StageAverager
from agoractl.runtime.direct_mixing import DirectMixing
from agoractl.runtime.join import join_stage, serve_state
from agoractl.runtime.stage_peers import StagePeers
from agoractl.training.fgdiloco_rounds import FGDiLoCoRounds, TransportMixing
from agoractl.training.replica_writes import ReplicaWrites

DEADLINE_SLACK_S = 10.0
"""The outer rounds wait this much longer than the direct transport's own deadline for a mix's result."""


class FGDiLoCoNode:
    """The FGDiLoCo side of one worker (a :class:`~agoractl.training.data_parallel.DataParallelMethod`).
    Give it the hivemind `averager`, or `direct`, which builds the direct transport from the stage's live peers.
    Create after the Worker, then :meth:`join`, :meth:`start`; :meth:`shutdown` on exit."""

    def __init__(self, run: Run, worker, records, peer: str, averager: Optional[StageAverager] = None,
                 direct: Optional[Callable[[StagePeers], DirectMixing]] = None):
        if (averager is None) == (direct is None):
            raise ValueError("FGDiLoCoNode mixes over one transport: give averager or direct")
        self.run, self.worker = run, worker
        self.names = [n for n, p in worker.module.named_parameters() if p.requires_grad]
        self.peers = StagePeers(records, worker.name, peer, run.workers.announce_period_s)
        if averager is not None:
            self.transport = averager
            mixing, deadline_s = TransportMixing(averager, self.peers.live_now), averager.round_deadline_s
        else:
            self.transport = mixing = direct(self.peers)
            deadline_s = mixing.round_deadline_s + DEADLINE_SLACK_S
        if averager is not None or worker.role == "operator":  # hivemind's averager shares as operators only
            self.transport.state_provider = serve_state(worker)
        self.rounds = FGDiLoCoRounds(run, worker, mixing, deadline_s)
        self.writes = ReplicaWrites(run, worker, self.names, peer, publisher=self.peers.first_operator,
                                    extra_state=lambda: {"fgdiloco": self.rounds.outer_state()})
        worker.step_callbacks.append(lambda step, w: self.writes.on_step(step + 1, w.phase))
        self.join_facts: dict[str, Any] = {"source": "init", "loaded_step": 0}

    def join(self, stage_step: int) -> dict[str, Any]:
        """A worker joining a stage that already trained loads its state (a live peer, else the store)."""
        source, loaded = join_stage(self.run, self.worker, self.transport, stage_step)
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
            self.transport.shutdown()
        except Exception:
            pass
