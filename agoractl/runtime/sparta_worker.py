"""AsyncSPARTA wired into a worker process (report §3.3.1.7, §4.2): the rounds over the real transport.

The round logic (when a round starts and with what weight, waiting for the previous one, skipping,
catching up, preemption, the sync phases' weight 0, applying the delta rule) is
:class:`~agoractl.training.sparta_rounds.SpartaRounds`; this module hands it what only a networked
node has:

- the stage's averaging transport (:class:`~agoractl.runtime.averaging.StageAverager`, built by the
  worker node from ``data_parallel.sparta`` and injected);
- a watcher thread on the DHT: the stage's live workers (the group size to wait for,
  :class:`~agoractl.runtime.stage_peers.StagePeers`) and preemption signals
  (:mod:`agoractl.runtime.faults`), handed to the rounds;
- joining: a worker of a stage that already trained loads its state from a live peer or the
  checkpoint store (:mod:`agoractl.runtime.join`) and, if stale, starts in the sync phases; its phase
  is announced in its DHT record (`on_phase`); with no other serving replica left in its stage it goes
  active at once;
- replica snapshots every ``checkpoints.snapshots_every_steps`` (for ``analyze divergence``) and, on
  operators, stage checkpoints every ``checkpoints.every_steps``, written in the background
  (:class:`~agoractl.training.replica_writes.ReplicaWrites`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from agoractl import logs
from agoractl.manifest.schema import Run
from agoractl.runtime import faults
from agoractl.runtime.averaging import StageAverager
from agoractl.runtime.join import join_stage, serve_state
from agoractl.runtime.stage_peers import StagePeers
from agoractl.training.replica_writes import ReplicaWrites
from agoractl.training.sparta_rounds import SpartaRounds


class SpartaWorker:
    """The SPARTA side of one worker (a :class:`~agoractl.training.data_parallel.DataParallelMethod`).
    Create after the Worker, call :meth:`join`, then :meth:`start`; :meth:`shutdown` on exit."""

    def __init__(self, run: Run, worker, averager: StageAverager, dht, records, peer: str,
                 on_phase: Optional[Callable[[str], None]] = None):
        self.run, self.worker, self.averager, self.dht, self.records = run, worker, averager, dht, records
        self.stage = worker.name
        self.log = logs.get("sparta")
        self.peers = StagePeers(records, self.stage, peer, run.workers.announce_period_s, on_read=self._read_signals)
        names = [n for n, _ in worker.module.named_parameters()]
        self.writes = ReplicaWrites(run, worker, names, peer, publisher=self.peers.first_operator)
        self.rounds = SpartaRounds(run, worker, averager, self.peers, peer, writes=self.writes, on_phase=on_phase)
        self.averager.state_provider = serve_state(worker)
        self.join_facts: dict[str, Any] = {"source": "init", "loaded_step": 0, "stale_steps": 0}

    def join(self, stage_step: int) -> dict[str, Any]:
        """Load the stage's state if the stage already trained, and choose the starting phase."""
        source, loaded = join_stage(self.run, self.worker, self.averager, stage_step)
        if source != "init":  # loading took time: how far the stage is now
            try:
                stage_step = max([stage_step, *(p.step for p in self.records.stage_progress(self.stage).values())])
            except Exception:
                pass
        stale = max(0, stage_step - loaded)
        phase = self.rounds.enter(stale, stage_step)
        self.join_facts = {"source": source, "loaded_step": loaded, "stale_steps": stale, "stage_step": stage_step}
        self.log.info("joined stage", stage=self.stage, source=source, loaded_step=loaded, stale_steps=stale,
                      phase=phase)
        return self.join_facts

    def _read_signals(self) -> None:
        """On the watcher thread, after every read of the stage's workers."""
        if self.peers.alone():
            self.rounds.alone()
        self.rounds.signals = faults.read_signals(self.dht, self.run.metadata.name, self.stage)

    def start(self) -> None:
        self.peers.start()

    def summary(self) -> dict[str, Any]:
        """What goes into the worker's final stats."""
        return {**self.rounds.summary(), "join": self.join_facts}

    def shutdown(self) -> None:
        self.rounds.cancel()
        self.writes.shutdown()
        self.peers.stop()
        try:
            self.averager.shutdown()
        except Exception:
            pass
