"""AsyncSPARTA rounds of one worker (report §3.3.1.7, §4.2): when a round starts, with what weight,
what it waits for, and how its result is applied. No networking: the rounds run over an injected
:class:`~agoractl.training.data_parallel.AveragingTransport` (hivemind in a worker node, an in-memory
one in the unit tests) and read the stage's live replicas from an injected
:class:`~agoractl.training.data_parallel.StageView`.

Attached to a :class:`~agoractl.training.worker.Worker` through its step callback (the compute
thread, between optimizer steps, where the weights may change):

- after the stage's step ``k * every_steps`` the worker snapshots segment ``round mod n_segments``
  of its master weights (:class:`~agoractl.algorithms.sparta.SegmentTiling` from the manifest's seed)
  and starts averaging it in the background, weighted by the samples it contributed since its last
  round (0 in the sync phases, :mod:`agoractl.algorithms.sync_phases`);
- at every later step callback it checks the round: once done, the result is applied with the
  delta rule (:func:`~agoractl.algorithms.sparta.apply_round`; values that did not come back keep
  their local values), and the round's record is kept and emitted as a ``round`` event
  (self-termination counts failures);
- a round due while the previous one still runs (rounds slower than ``every_steps`` steps) waits
  for it first: every replica takes part in every round, in order, and the steps slow to the pace
  of averaging rather than letting the replicas drift into different rounds; the wait is recorded
  (``waited_s``). Meanwhile the worker answers the trainers' forwards, and their backwards until the
  step's batch is complete (:meth:`~agoractl.training.worker.Worker.serve_once`): a short wait
  costs the trainers nothing, and no step absorbs several batches. It stops waiting once nobody
  can come to the previous round: no other replica serves (the partner died mid-round: the new
  round is skipped), or all of them announce later rounds (each announces the round it is
  averaging in its record, :class:`~agoractl.runtime.stage_peers.StagePeers`): a previous round
  still looking for a group is then given up (cancelled, recorded as skipped) and the new one
  begins; one already in its all-reduce keeps the averager, and the new round is skipped;
- a worker a round or more behind the stage's step (after such a wait; a joiner catching up with
  the stage's step counter) begins the stage's current round instead of its own, and the rounds it
  jumped over are not begun: the replicas meet again. A replica a step or two behind keeps its
  round. With no other replica alive, or all the others in a later round, the round is skipped. A
  round that formed no group while no other replica serves (the others left, or are joiners still
  in weight sync), or while all of them were averaging other rounds, is skipped too, not failed:
  only failures with a partner to average with count toward self-termination. So is a round given up,
  unless this worker gave up as many rounds in a row as the self-termination window holds: a worker
  whose rounds never meet its stage's (too slow, a link too thin) does not average, and leaves;
- a worker in a sync phase whose stage has no other serving replica goes active (:meth:`SpartaRounds.alone`,
  called by the node's watcher): nobody is left to catch up with, and the stage would stop stepping;
- a preemption signal aimed at this worker (:attr:`SpartaRounds.signals`, kept current by the
  node's DHT watcher) is armed, once, for the next round it starts.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Optional

import torch

from agoractl import logs
from agoractl.algorithms.sparta import SegmentTiling, apply_round, round_summary
from agoractl.algorithms.sync_phases import SyncPhases
from agoractl.manifest.schema import Run
from agoractl.training.fault_drill import corrupt_part
from agoractl.training.data_parallel import AveragingTransport, PendingAverage, RoundRecord, StageView


class SpartaRounds:
    """The SPARTA rounds of one worker over `transport`; registers itself as a step callback.

    `peer` is this worker's id (preemption signals name their targets by it); `writes`, if given,
    gets ``on_step(step, phase, meta)`` after every step (replica snapshots, operator checkpoints);
    `on_phase` is called with every new sync phase.
    """

    def __init__(self, run: Run, worker, transport: AveragingTransport, peers: StageView, peer: str = "",
                 writes=None, on_phase: Optional[Callable[[str], None]] = None):
        self.run, self.worker, self.transport, self.peers, self.peer = run, worker, transport, peers, peer
        self.writes, self.on_phase = writes, on_phase
        self.cfg = run.data_parallel.sparta
        named = list(worker.module.named_parameters())
        if any(not p.requires_grad for _, p in named):
            raise ValueError("SPARTA tiles trainable parameters; this stage has frozen parameters")
        self.names = [n for n, _ in named]
        self.master = dict(zip(self.names, worker.master))
        self.compute = dict(zip(self.names, worker.params))
        self.tiling = SegmentTiling({n: tuple(p.shape) for n, p in named}, run.n_segments(), self.cfg.seed)
        self.phases = SyncPhases(run.join, 0)
        self._phase_lock = threading.Lock()  # the compute thread's steps and the watcher's alone()
        self.pending: Optional[tuple[PendingAverage, torch.Tensor]] = None
        self.last_begun = -1
        """The latest round this worker began."""
        self._abandoned: Optional[int] = None
        """The round this worker gave up while it looked for a group (:meth:`begin`)."""
        self.given_up_in_a_row = 0
        """Rounds given up since this worker's last round with the others (complete, partial or empty)."""
        self.waited_s: dict[int, float] = {}
        """Per round, how long the compute thread waited for the previous round before starting it."""
        self.rounds: list[dict] = []
        self.samples_since_round = 0
        self.last_segment: Optional[int] = None
        self.signals: list = []
        """Preemption signals of the stage (``id``, ``targets``, ``during``), replaced by the node's watcher."""
        self.acted: set[str] = set()
        self.log = logs.get("sparta")
        worker.step_callbacks.append(self.on_step)

    # -- sync phases --------------------------------------------------------------------------

    def enter(self, stale_steps: int, stage_step: int) -> str:
        """A worker `stale_steps` behind its stage (at `stage_step`) starts in its first sync phase."""
        self.phases = SyncPhases(self.run.join, stale_steps, stage_step)
        self._set_phase(self.phases.phase)
        return self.phases.phase

    def alone(self) -> Optional[str]:
        """The stage has no other serving replica (the watcher's finding): a worker in a sync phase goes
        active at once; returns the new phase on a change."""
        with self._phase_lock:
            changed = self.phases.alone(self.worker.progress.step)
        if changed is not None:
            self._set_phase(changed)
            self.log.warning("sync phase", phase=changed, step=self.worker.progress.step,
                             reason="no other serving replica of the stage")
        return changed

    def _set_phase(self, phase: str) -> None:
        self.worker.phase = phase
        self.worker.emit("phase", phase=phase, step=self.worker.progress.step)
        if self.on_phase is not None:
            self.on_phase(phase)

    # -- the step callback (compute thread) ---------------------------------------------------

    def on_step(self, step: int, worker) -> None:
        done = step + 1  # steps the stage has completed
        if worker.stats.steps:
            self.samples_since_round += int(worker.stats.steps[-1][2])
        # Sync phases last a number of the stage's steps: steps this worker takes only to catch up with
        # its stage's counter (a joiner whose counter starts behind its loaded state) do not count.
        with self._phase_lock:
            changed = None if worker.progress.ahead() else self.phases.on_step(done)
        if changed is not None:
            self._set_phase(changed)
            self.log.info("sync phase", phase=changed, step=done)
        self.collect()
        if self.writes is not None:
            self.writes.on_step(done, self.phases.phase,
                                None if self.last_segment is None else {"last_averaged_segment": self.last_segment})
        # No round after the last step: the stage is done and its workers are leaving.
        if done % self.cfg.every_steps == 0 and done < self.run.training.stop_step:
            self.begin(done // self.cfg.every_steps - 1, done)

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
        self.worker.averaging_round = None
        average, averaged, rec = pending.result(timeout=1.0)
        if rec.round == self._abandoned and average is None:
            # Once, after a churn, a replica out of step with its stage: not its failure. A worker whose rounds keep
            # missing its stage's (too slow to meet them, a link that cannot carry them) is not averaging: from
            # the window's worth of give-ups in a row on, each counts as a failure (self-termination).
            self.given_up_in_a_row += 1
            rec.error = "given up: the other replicas are averaging later rounds"
            if self.given_up_in_a_row < self.run.workers.self_termination.window_rounds:
                rec.status = "skipped"
            else:
                rec.status, rec.error = "failed", f"{rec.error} ({self.given_up_in_a_row} given up in a row)"
        elif rec.status == "failed" and rec.group_size == 0 and self.peers.serving_others_now == 0:
            # Nobody to average with (the other replicas left, or only joiners still in weight sync are
            # there): not this worker's failure, and no reason for it to self-terminate.
            rec.status, rec.error = "skipped", "no other serving replica of the stage"
        elif rec.status == "failed" and not rec.grouped and self._elsewhere(rec.round):
            # The others were all in other rounds (a partner's previous round outlasted this one's window, a
            # newcomer counting from the stage's step): nobody missed this worker, and the next rounds realign.
            rec.status, rec.error = "skipped", "the other replicas were averaging other rounds"
        if rec.status in ("complete", "partial", "empty"):
            self.given_up_in_a_row = 0
        if average is not None:
            apply_round(self.master, self.tiling, pending.segment, snapshot, average, self.cfg.delta_rule, averaged)
            if self.compute is not self.master:
                for name in self.names:
                    if self.compute[name] is not self.master[name]:
                        self.compute[name].copy_(self.master[name], non_blocking=True)
            self.last_segment = pending.segment
        self.tiling.release(pending.segment)
        return self._record(rec, applied_at=self.worker.progress.step)

    def _record(self, rec: RoundRecord, **extra) -> dict:
        d = {**rec.as_dict(), "phase": self.phases.phase, "waited_s": self.waited_s.pop(rec.round, 0.0), **extra}
        self.rounds.append(d)
        self.worker.emit("round", **{k: v for k, v in d.items() if k != "error"}, error=rec.error)
        if rec.status in ("failed", "partial"):
            self.log.warning("averaging round", round=rec.round, status=rec.status,
                             averaging_success=rec.averaging_success, error=rec.error)
        return d

    def _fault(self, round_index: int) -> Optional[str]:
        """The preemption point armed for this round: the first signal aimed at this worker not yet
        acted on (each signal strikes once)."""
        sig = fault_for(self.signals, self.peer, self.acted)
        if sig is None:
            return None
        self.acted.add(sig.id)
        self.log.warning("preemption armed", signal=sig.id, during=sig.during, round=round_index)
        return sig.during

    def _elsewhere(self, round_index: int) -> bool:
        """Whether the other serving replicas are all averaging other rounds than `round_index` (at least one
        announces one), and none was seen in it: the round missed them, not they it. One between rounds, or
        whose short rounds the records never caught, is no such evidence."""
        rounds = self._announced()
        return bool(rounds) and round_index not in rounds.values() and not self.peers.seen_in_round(round_index)

    def _others_past(self, round_index: int) -> bool:
        """Whether every other serving replica (at least one) announces a round later than `round_index`."""
        rounds = self._announced()
        return bool(rounds) and min(rounds.values()) > round_index

    def _announced(self) -> dict[str, int]:
        """The round each other serving replica announces, if every one of them announces one (else empty)."""
        rounds = self.peers.rounds_now
        return rounds if len(rounds) >= self.peers.serving_others_now else {}

    def _partners_may_come(self) -> bool:
        """Whether another replica may still come to the running round: one serves, and not all of them
        are averaging later rounds."""
        return self.peers.serving_others_now > 0 and not self._others_past(self.pending[0].round)

    def begin(self, round_index: int, step: int) -> None:
        """Start round `round_index` after the stage's step `step` (or record why it did not start): the
        stage's current round instead where this worker is behind it."""
        if round_index <= self.last_begun:
            return  # it took part in this round already: it joined it with the stage, ahead of its own count
        segment = round_index % self.tiling.segments
        waited = 0.0
        if self.pending is not None:
            # Rounds slower than every_steps steps: wait for the previous one rather than skip or delay
            # this one, so that every replica takes part in every round, in order (skipping here would
            # leave the replicas in different rounds, and none of them would find a group). The worker
            # answers requests meanwhile (forwards, and backwards up to the step's batch). It stops waiting
            # once nobody can come to the previous round: no other replica serves (the partner died
            # mid-round), or all of them announce later rounds.
            t0 = time.monotonic()
            deadline = t0 + self.transport.round_deadline_s
            while self.pending is not None and time.monotonic() < deadline and self._partners_may_come():
                if self.collect() is None:
                    self.worker.serve_once(min(0.05, max(0.0, deadline - time.monotonic())), stepping=False)
            waited = time.monotonic() - t0
            if (self.pending is not None and self.peers.serving_others_now > 0
                    and self._others_past(self.pending[0].round) and self.pending[0].looking()):
                # Every other serving replica averages a later round and this one still looks for a group:
                # give it up, and begin the stage's current round, where they are (a replica busy with a
                # round nobody comes to would miss every round they begin meanwhile, and they its).
                self.pending[0].cancel()
                self._abandoned = self.pending[0].round
                self.collect(wait_s=5.0)
            if self.pending is not None and not self._partners_may_come():
                why = "no other replica serves" if self.peers.serving_others_now == 0 else \
                    "the other replicas are averaging later rounds"
                self._record(RoundRecord(round_index, segment, "skipped",
                                         error=f"the previous round still runs and {why}"), step=step)
                return
            if self.pending is not None:  # the transport is stuck past every deadline
                self._record(RoundRecord(round_index, segment, "failed", error="the previous round never ended"),
                             step=step)
                return
        current = self.worker.progress.stage_step() // self.cfg.every_steps - 1
        if current > round_index:
            # A round or more behind the stage's step (it waited for its previous round; a joiner catching up
            # with the stage's step counter): the others are in the stage's current round, and so is this one.
            # A replica a step or two behind (it learns of the stage's steps through the DHT) keeps its round.
            round_index, segment = current, current % self.tiling.segments
        if self.peers.live < 2:
            self._record(RoundRecord(round_index, segment, "skipped", error="no other replica of the stage"),
                         step=step)
            return
        if self._others_past(round_index):
            # Every other serving replica is averaging a later round (this one waited long for its previous
            # round): nobody will come to this one; the next due round meets them.
            self._record(RoundRecord(round_index, segment, "skipped",
                                     error="the other replicas are averaging a later round"), step=step)
            return
        weight = self.phases.averaging_weight(self.samples_since_round)
        self.samples_since_round = 0
        fault = self._fault(round_index)
        snapshot = self.tiling.gather(self.master, segment)
        try:
            sent = corrupt_part(getattr(self.worker, "fault", None), snapshot)  # the snapshot unless a fault drill
            pending = self.transport.begin_round(round_index, segment, sent, weight, self.peers.live, fault)
        except Exception as e:  # the transport is gone or stuck: this round fails
            self._record(RoundRecord(round_index, segment, "failed", weight=weight, error=f"{type(e).__name__}: {e}"),
                         step=step)
            return
        self.pending = (pending, snapshot)
        self.last_begun = round_index
        self.worker.averaging_round = round_index
        self.waited_s[round_index] = round(waited, 3)

    # -- lifecycle ----------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """What goes into the worker's final stats."""
        return {"rounds": self.rounds, "phases": [list(h) for h in self.phases.history],
                "sparta": round_summary(self.rounds)}

    def cancel(self) -> None:
        """Give up on the running round (shutdown)."""
        if self.pending is not None:
            try:
                self.pending[0].cancel()
            except Exception:
                pass


def fault_for(signals: Iterable, peer: str, acted: set[str]):
    """The first signal targeting `peer` not yet acted on (ids in `acted`), or None."""
    for sig in signals:
        if peer in sig.targets and sig.id not in acted:
            return sig
    return None
