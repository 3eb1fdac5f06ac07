"""AsyncSPARTA in a worker (report §3.3.1.7, §4.2): rounds on the stage's step cadence, sync phases,
per-round records, replica snapshots and operator checkpoints.

Attached to a :class:`~agoractl.training.worker.Worker` through its step callback (the compute
thread, between optimizer steps, where the weights may change):

- after the stage's step ``k * every_steps`` the worker snapshots segment ``round mod n_segments``
  of its master weights (:class:`~agoractl.algorithms.sparta.SegmentTiling` from the manifest's seed)
  and starts averaging it in the background (:class:`~agoractl.runtime.averaging.SpartaAverager`),
  weighted by the samples it contributed since its last round (0 in the sync phases);
- at every later step callback it checks the round: once done, the result is applied with the
  delta rule (``apply_round``; values that did not come back keep their local values), and the
  round's record is kept and emitted as a ``round`` event (self-termination counts failures);
- a round due while the previous one still runs (rounds slower than ``every_steps`` steps) waits
  for it first: every replica takes part in every round, in order, and training slows to the pace
  of averaging rather than letting the replicas drift into different rounds; the wait is recorded
  (``waited_s``). With no other replica alive, or while a joiner catches up with the stage's step
  counter, the round is skipped;
- a joining worker loads its stage's state (:mod:`agoractl.runtime.join`) and, if stale, runs the
  sync phases (:mod:`agoractl.algorithms.sync_phases`): its phase is announced in its DHT record;
- replica snapshots every ``checkpoints.snapshots_every_steps`` (for ``analyze divergence``) and,
  on operators, stage checkpoints every ``checkpoints.every_steps`` are written in the background.

A watcher thread reads the DHT: the stage's live workers (the group size to wait for) and
preemption signals (:mod:`agoractl.runtime.faults`), armed for the next round they target.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from agoractl import logs
from agoractl.manifest.schema import Run
from agoractl.ops.checkpoint import CheckpointStore
from agoractl.runtime import faults
from agoractl.runtime.averaging import PendingRound, RoundRecord, SpartaAverager
from agoractl.runtime.join import apply_state, load_stage_state, pack_state, unpack_state
from agoractl.training.replica_writes import ReplicaWrites
from agoractl.algorithms.sparta import SegmentTiling, apply_round, round_summary
from agoractl.runtime.stage_peers import StagePeers
from agoractl.algorithms.sync_phases import SyncPhases

def averager_prefix(run: str, stage: str) -> str:
    """The stage's averaging group in the DHT (hivemind prefixes may not contain dots)."""
    return f"{run}_{stage}_sparta".replace(".", "_")


class SpartaWorker:
    """The SPARTA side of one worker. Create after the Worker, call :meth:`join`, then :meth:`start`."""

    def __init__(self, run: Run, worker, dht, records, peer: str,
                 on_phase: Optional[Callable[[str], None]] = None):
        self.run, self.worker, self.dht, self.records, self.peer = run, worker, dht, records, peer
        self.stage = worker.name
        self.on_phase = on_phase
        self.cfg = run.data_parallel.sparta
        self.log = logs.get("sparta")
        named = list(worker.module.named_parameters())
        if any(not p.requires_grad for _, p in named):
            raise ValueError("SPARTA tiles trainable parameters; this stage has frozen parameters")
        self.names = [n for n, _ in named]
        self.master = dict(zip(self.names, worker.master))
        self.compute = dict(zip(self.names, worker.params))
        self.tiling = SegmentTiling({n: tuple(p.shape) for n, p in named}, run.n_segments(), self.cfg.seed)
        self.averager = SpartaAverager(
            dht, prefix=averager_prefix(run.metadata.name, self.stage), capacity=self.tiling.max_size(),
            client_mode=worker.role == "contributor", matchmaking_timeout_s=self.cfg.matchmaking_timeout_s,
            allreduce_timeout_s=self.cfg.allreduce_timeout_s, chunk_timeout_s=self.cfg.chunk_timeout_s,
            chunk_bytes=self.cfg.chunk_bytes, wire_dtype=self.cfg.wire_dtype,
            startup_timeout_s=run.network.startup_timeout_s)
        self.averager.state_provider = self._state
        self.phases = SyncPhases(run.join, 0)
        self.join_facts: dict[str, Any] = {"source": "init", "loaded_step": 0, "stale_steps": 0}
        self.pending: Optional[tuple[PendingRound, torch.Tensor]] = None
        self.waited_s: dict[int, float] = {}
        """Per round, how long the compute thread waited for the previous round before starting it."""
        self.rounds: list[dict] = []
        self.samples_since_round = 0
        self.last_segment: Optional[int] = None
        self.peers = StagePeers(records, self.stage, peer, run.workers.announce_period_s, on_read=self._read_signals)
        self.writes = ReplicaWrites(run, worker, self.names, peer, publisher=self.peers.first_operator)
        self.signals: list[faults.PreemptSignal] = []
        self.acted: set[str] = set()
        worker.step_callbacks.append(self.on_step)

    # -- joining ------------------------------------------------------------------------------

    def _state(self):
        """The stage state served to joining peers (hivemind's background thread)."""
        return pack_state(list(zip(self.names, self.worker.master)), self.worker.optimizer, self.stage,
                          self.worker.progress.step)

    def _from_peers(self):
        found = self.averager.load_stage_state(timeout=self.run.network.startup_timeout_s)
        return None if found is None else unpack_state(*found)

    def _from_store(self):
        store = CheckpointStore(self.run)
        if store.latest_step(self.stage) is None:
            return None
        return store.load(self.stage)

    def join(self, stage_step: int) -> dict[str, Any]:
        """Load the stage's state if the stage already trained, and choose the starting phase."""
        loaded, source = 0, "init"
        if stage_step > 0:
            state, source = load_stage_state(self.worker.role, self._from_peers, self._from_store)
            if state is not None:
                loaded = apply_state(state, self.worker.module, self.worker.optimizer, self.worker.master)
        if source != "init":  # loading took time: how far the stage is now
            try:
                stage_step = max([stage_step, *(p.step for p in self.records.stage_progress(self.stage).values())])
            except Exception:
                pass
        stale = max(0, stage_step - loaded)
        self.phases = SyncPhases(self.run.join, stale, stage_step)
        self._set_phase(self.phases.phase)
        self.join_facts = {"source": source, "loaded_step": loaded, "stale_steps": stale, "stage_step": stage_step}
        self.log.info("joined stage", stage=self.stage, source=source, loaded_step=loaded, stale_steps=stale,
                      phase=self.phases.phase)
        return self.join_facts

    def _set_phase(self, phase: str) -> None:
        self.worker.phase = phase
        self.worker.emit("phase", phase=phase, step=self.worker.progress.step)
        if self.on_phase is not None:
            self.on_phase(phase)

    # -- the DHT watcher ----------------------------------------------------------------------

    def start(self) -> None:
        self.peers.start()

    def _read_signals(self) -> None:
        self.signals = faults.read_signals(self.dht, self.run.metadata.name, self.stage)

    # -- the step callback (compute thread) ---------------------------------------------------

    def on_step(self, step: int, worker) -> None:
        done = step + 1  # steps the stage has completed
        if worker.stats.steps:
            self.samples_since_round += int(worker.stats.steps[-1][2])
        # Sync phases last a number of the stage's steps: steps this worker takes only to catch up with
        # its stage's counter (a joiner whose counter starts behind its loaded state) do not count.
        changed = None if worker.progress.ahead() else self.phases.on_step(done)
        if changed is not None:
            self._set_phase(changed)
            self.log.info("sync phase", phase=changed, step=done)
        self.collect()
        self.writes.on_step(done, self.phases.phase,
                            None if self.last_segment is None else {"last_averaged_segment": self.last_segment})
        # No round after the last step: the stage is done and its workers are leaving.
        if done % self.cfg.every_steps == 0 and done < self.run.training.max_steps:
            self._begin(done // self.cfg.every_steps - 1, done)

    def collect(self, wait_s: float = 0.0) -> Optional[dict]:
        """Apply the running round if it finished (waiting up to `wait_s` for it); returns its record."""
        if self.pending is None:
            return None
        deadline = time.monotonic() + wait_s
        while not self.pending[0].done():
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)
        pending, snapshot = self.pending
        self.pending = None
        average, averaged, rec = pending.result(timeout=1.0)
        if rec.status == "failed" and rec.group_size == 0 and self.peers.others_now == 0:
            # Nobody to average with (the other replicas left): not this worker's failure.
            rec.status, rec.error = "skipped", "no other replica of the stage"
        if average is not None:
            apply_round(self.master, self.tiling, pending.segment, snapshot, average, self.cfg.delta_rule, averaged)
            if self.compute is not self.master:
                for name in self.names:
                    if self.compute[name] is not self.master[name]:
                        self.compute[name].copy_(self.master[name], non_blocking=True)
            self.last_segment = pending.segment
        self.tiling.release(pending.segment)
        return self._record(rec, applied_at=self.worker.progress.step)

    def round_deadline_s(self) -> float:
        """The longest a round can last: matchmaking (two windows for a contributor) and the all-reduce."""
        return 2 * self.cfg.matchmaking_timeout_s + self.cfg.allreduce_timeout_s + 10.0

    def _record(self, rec: RoundRecord, **extra) -> dict:
        d = {**rec.as_dict(), "phase": self.phases.phase, "waited_s": self.waited_s.pop(rec.round, 0.0), **extra}
        self.rounds.append(d)
        self.worker.emit("round", **{k: v for k, v in d.items() if k != "error"}, error=rec.error)
        if rec.status in ("failed", "partial"):
            self.log.warning("averaging round", round=rec.round, status=rec.status,
                             averaging_success=rec.averaging_success, error=rec.error)
        return d

    def _begin(self, round_index: int, step: int) -> None:
        segment = round_index % self.tiling.segments
        waited = 0.0
        if self.pending is not None:
            # Rounds slower than every_steps steps: wait for the previous one rather than skip or delay
            # this one, so that every replica takes part in every round, in order (skipping here would
            # leave the replicas in different rounds, and none of them would find a group).
            t0 = time.monotonic()
            self.collect(wait_s=self.round_deadline_s())
            waited = time.monotonic() - t0
            if self.pending is not None:  # the averager is stuck past every deadline
                self._record(RoundRecord(round_index, segment, "failed", error="the previous round never ended"),
                             step=step)
                return
        if self.worker.progress.stage_step() - step >= self.cfg.every_steps:
            # Catching up with the stage's step (a joiner whose state is newer than its step counter):
            # the other replicas have moved past this round. A replica a step or two behind (it learns
            # of the stage's steps through the DHT) still meets the others in this round's matchmaking.
            self._record(RoundRecord(round_index, segment, "skipped", error="catching up with the stage's step"),
                         step=step)
            return
        if self.peers.live < 2:
            self._record(RoundRecord(round_index, segment, "skipped", error="no other replica of the stage"),
                         step=step)
            return
        weight = self.phases.averaging_weight(self.samples_since_round)
        self.samples_since_round = 0
        fault = None
        sig = faults.fault_for(self.signals, self.peer, self.acted)
        if sig is not None:
            self.acted.add(sig.id)
            fault = sig.during
            self.log.warning("preemption armed", signal=sig.id, during=fault, round=round_index)
        snapshot = self.tiling.gather(self.master, segment)
        try:
            pending = self.averager.begin_round(round_index, segment, snapshot, weight, self.peers.live, fault)
        except Exception as e:  # the averager process is gone or stuck: this round fails
            self._record(RoundRecord(round_index, segment, "failed", weight=weight, error=f"{type(e).__name__}: {e}"),
                         step=step)
            return
        self.pending = (pending, snapshot)
        self.waited_s[round_index] = round(waited, 3)

    # -- lifecycle ----------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """What goes into the worker's final stats."""
        return {"rounds": self.rounds, "phases": [list(h) for h in self.phases.history], "join": self.join_facts,
                "sparta": round_summary(self.rounds)}

    def shutdown(self) -> None:
        if self.pending is not None:
            try:
                self.pending[0].control.cancel()
            except Exception:
                pass
        self.writes.shutdown()
        self.peers.stop()
        try:
            self.averager.shutdown()
        except Exception:
            pass
