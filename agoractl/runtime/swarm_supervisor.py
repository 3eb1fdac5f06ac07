"""Supervision of a local swarm's nodes (``agoractl launch swarm``, report §3.7: the orchestrator keeps the
worker and trainer stacks at their size; §3.3.1.1: a failed worker is replaced by a fresh one that loads
the stage state).

- :class:`RestartPolicy` (pure): a restart budget per node, ``local.max_restarts`` like torchrun's
  ``--max-restarts``, and exponential backoff from ``local.restart_backoff_s``.
- :class:`StallClock` (pure): seconds since the last completed optimizer step (or the last restart);
  :func:`stall_cause` names why, in one line: a stage without a running worker, no trainer, or the DHT.
- :class:`Supervisor`: what :class:`~agoractl.runtime.swarm.Swarm` calls every look at its nodes. A
  worker or trainer whose process exited (any code, killed, a self-termination rule) is started again
  through the ordinary ``launch worker|trainer`` path, so it joins as any newcomer does (state from
  peers or the store, sync phases); a node that finished its work (a trainer at ``max_steps`` or out
  of data, a worker whose stage is done) is not. When no step completed for ``local.stall_timeout_s``
  and no restart is pending, it raises :class:`~agoractl.errors.StalledRun` naming the cause.
- :class:`StopSignals`: SIGINT and SIGTERM stop the launcher once (a ``KeyboardInterrupt`` in the main
  thread); while the swarm stops, further signals only note themselves; if the launcher is still alive
  :data:`STOP_BOUND_S` after the first signal, every node's process group is killed and it exits.

Everything here runs in the launcher; the pure parts are tested without processes
(``tests/runtime/test_swarm_supervisor.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from agoractl.algorithms.termination import EXIT_CODES, EXIT_PREEMPTED
from agoractl.errors import StalledRun
from agoractl.runtime.records import SERVING_PHASES
from agoractl.training.node_stats import FINISHED_REASONS, TrainerNodeStats, WorkerNodeStats

BACKOFF_CAP_S = 60.0
"""The longest wait before a restart, however many restarts came before."""
STOP_BOUND_S = 40.0
"""Seconds from the first SIGINT/SIGTERM by which the launcher and every process it started are gone
(graceful stops take up to ``swarm.STOP_GRACE_S``, 25 s; then SIGKILL, the report and the launcher's own
DHT node)."""
STALL_NOTE_S = 30.0
"""While stalled but waiting for a restart: seconds between console lines saying why."""


# -- pure policy --------------------------------------------------------------------------------


class RestartPolicy:
    """How many times each node (by name) may be started again, and after what wait."""

    def __init__(self, max_restarts: int, backoff_s: float, cap_s: float = BACKOFF_CAP_S):
        self.max_restarts, self.backoff_s, self.cap_s = int(max_restarts), float(backoff_s), float(cap_s)
        self.restarts: dict[str, int] = {}

    def delay(self, name: str) -> Optional[float]:
        """Seconds to wait before restarting `name`, or None when its budget is spent."""
        done = self.restarts.get(name, 0)
        if done >= self.max_restarts:
            return None
        return min(self.cap_s, self.backoff_s * 2.0 ** done)

    def record(self, name: str) -> int:
        """Count one restart of `name`; returns how many it has had."""
        self.restarts[name] = self.restarts.get(name, 0) + 1
        return self.restarts[name]


class StallClock:
    """No progress for `timeout_s`: progress is any increase of a monotone counter (the stages' steps);
    a restart also restarts the clock (the newcomer gets the full timeout to join and serve)."""

    def __init__(self, timeout_s: float, now: float):
        self.timeout_s = float(timeout_s)
        self.since = now
        self.progress = -1

    def observe(self, progress: int, now: float) -> None:
        """`progress` as of `now` (the time of the look that read it: the step happened by then)."""
        if progress > self.progress:
            if self.progress >= 0:
                self.since = max(self.since, now)
            self.progress = progress

    def reset(self, now: float) -> None:
        self.since = now

    def idle_s(self, now: float) -> float:
        return max(0.0, now - self.since)

    def stalled(self, now: float) -> bool:
        return self.idle_s(now) >= self.timeout_s


def describe_exit(code: Optional[int]) -> str:
    """A process's end in words: the signal that killed it, the self-termination rule, or the code."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    rules = {v: k for k, v in EXIT_CODES.items()}
    if code in rules:
        return f"self-termination rule {rules[code]} (exit code {code})"
    if code == EXIT_PREEMPTED:
        return f"preempted (exit code {code})"
    return f"exit code {code}"


def stall_cause(stages: dict[str, int], trainers_running: int, dht_error: Optional[str] = None,
                last_exit: Optional[dict[str, str]] = None) -> str:
    """Why no step completes, in one clause. `stages`: running workers per stage; `last_exit`: per stage
    (or "trainers") how its last node ended, e.g. "worker-tail-0 killed by SIGKILL; restart budget spent"."""
    last_exit = last_exit or {}
    if dht_error:
        return f"the DHT is unreachable from the launcher ({dht_error})"
    empty = [s for s, n in stages.items() if n == 0]
    if empty:
        return "; ".join(f"stage {s} has no live worker" + (f" ({last_exit[s]})" if s in last_exit else "")
                         for s in empty)
    if trainers_running == 0:
        return "no trainer is running" + (f" ({last_exit['trainers']})" if "trainers" in last_exit else "")
    return "every stage has a live worker and a trainer is running, yet no step completes (see the node logs)"


# -- the launcher's side -------------------------------------------------------------------------


@dataclass
class Slot:
    """A node the swarm keeps alive, by its first name (worker-tail-0, trainer-1), and its incarnations."""

    name: str
    kind: str
    stage: Optional[str] = None
    index: Optional[int] = None
    nodes: list = field(default_factory=list)
    due: Optional[float] = None  # a restart is pending at this monotonic time
    settled: bool = False  # its last incarnation exited and will not be started again
    done: bool = False  # ... because its work was finished (a worker's stage reached its last step)

    @property
    def current(self):
        return self.nodes[-1]


class Supervisor:
    """Keeps a :class:`~agoractl.runtime.swarm.Swarm`'s workers and trainers alive, and ends a stalled run."""

    def __init__(self, swarm, clock: Callable[[], float] = time.monotonic):
        self.swarm, self.now = swarm, clock
        local = swarm.run.local
        self.policy = RestartPolicy(local.max_restarts, local.restart_backoff_s)
        self.stall = StallClock(local.stall_timeout_s, clock())
        self.slots: dict[str, Slot] = {}
        self.exits: list[dict] = []
        self.early_end: Optional[str] = None  # a trainer that ended before max_steps, and why
        self.stage_steps: dict[str, int] = {}
        self._last_exit: dict[str, str] = {}
        self._seed_noted = False
        self._stall_noted = 0.0
        self._complete = False  # every stage finished; trainers still running were told to stop

    def adopt(self) -> None:
        """Take over the nodes the swarm started; the stall clock starts now."""
        for n in self.swarm.nodes:
            if n.kind in ("worker", "trainer") and n.name not in self.slots:
                index = int(n.name.rsplit("-", 1)[1]) if n.kind == "trainer" else None
                self.slots[n.name] = Slot(n.name, n.kind, stage=n.stage, index=index, nodes=[n])
        self.stall.reset(self.now())

    def trainers(self) -> list:
        return [s.current for s in self.slots.values() if s.kind == "trainer"]

    def workers(self) -> list:
        return [s.current for s in self.slots.values() if s.kind == "worker"]

    def settled(self, node) -> bool:
        slot = self.slots.get(self._slot_name(node))
        return slot is not None and slot.current is node and slot.settled

    def restarts(self) -> dict[str, int]:
        return {name: self.policy.restarts.get(name, 0) for name in self.slots}

    def stage_restarts(self, stage: str) -> int:
        return sum(self.policy.restarts.get(s.name, 0) for s in self.slots.values() if s.stage == stage)

    def tick(self) -> None:
        """One look: handle exits, start what is due, raise :class:`StalledRun` on a stall."""
        now = self.now()
        self._check_seed()
        for slot in self.slots.values():
            n = slot.current
            if not slot.settled and slot.due is None and n.poll() is not None:
                self._exited(slot, n, now)
        for slot in self.slots.values():
            if slot.due is not None and now >= slot.due:
                self._restart(slot, now)
        self._observe_progress(now)
        self._stop_trainers_of_a_complete_run()
        if self.stall.stalled(now):
            cause = self.cause()
            pending = [s.name for s in self.slots.values() if s.due is not None]
            message = f"no optimizer step for {self.stall.idle_s(now):.0f} s: {cause}"
            if not pending:
                raise StalledRun(f"stalled: {message}",
                                 hint=f"see the logs in {self.swarm.dir / 'logs'}; raise local.max_restarts or "
                                      "local.stall_timeout_s, or fix what the node logs show")
            if now - self._stall_noted >= STALL_NOTE_S:
                self._stall_noted = now
                self.swarm.on_note(f"stalled: {message}; waiting for the restart of {', '.join(pending)}")

    def _stop_trainers_of_a_complete_run(self) -> None:
        """Every stage's workers finished (their stages reached the last step): a trainer still running (one
        that never got data to read, say) would wait for workers forever; it is stopped (SIGTERM)."""
        workers = [s for s in self.slots.values() if s.kind == "worker"]
        if self._complete or not workers or not all(s.done for s in workers):
            return
        running = [s.current for s in self.slots.values() if s.kind == "trainer" and s.current.poll() is None]
        self._complete = True
        if running:
            self.swarm.on_note(f"every stage reached its last step: stopping {', '.join(n.name for n in running)}")
            for n in running:
                with contextlib.suppress(ProcessLookupError):
                    n.proc.send_signal(signal.SIGTERM)

    def cause(self) -> str:
        running = {s: 0 for s in self.swarm.run.stage_names()}
        trainers = 0
        for slot in self.slots.values():
            alive = slot.current.poll() is None
            if slot.kind == "worker" and alive:
                running[slot.stage] = running.get(slot.stage, 0) + 1
            elif slot.kind == "trainer" and alive:
                trainers += 1
        return stall_cause(running, trainers, getattr(self.swarm.snapshot, "error", None), self._last_exit)

    # -- internals ------------------------------------------------------------------------------

    def _slot_name(self, node) -> str:
        return node.name.split(".r", 1)[0]

    def _check_seed(self) -> None:
        seed = next((n for n in self.swarm.nodes if n.kind == "dht"), None)
        if seed is not None and not self._seed_noted and seed.poll() is not None:
            self._seed_noted = True
            self.swarm.on_note(f"the DHT seed exited ({describe_exit(seed.exit_code)}); running nodes keep their "
                               f"DHT, but nodes started from now on cannot join through it")

    def _observe_progress(self, now: float) -> None:
        for stage, recs in getattr(self.swarm.snapshot, "workers", {}).items():
            steps = [r.step for r in recs.values() if r.phase in SERVING_PHASES]
            self.stage_steps[stage] = max([self.stage_steps.get(stage, 0), *steps])
        # The steps were there when the look began (a look at the DHT takes seconds on a loaded machine).
        looked = getattr(self.swarm.snapshot, "time", None)
        self.stall.observe(sum(self.stage_steps.values()), now - max(0.0, time.time() - looked) if looked else now)

    def _finished(self, slot: Slot, node) -> Optional[str]:
        """Why the node ended of its own accord, if it did (then it is not started again)."""
        if node.exit_code != 0:
            return None
        stats = _read_stats(node.stats_path)
        if slot.kind == "trainer":
            return (TrainerNodeStats.from_dict(stats).finished_reason if stats else "") or "finished"
        worker = WorkerNodeStats.from_dict(stats) if stats is not None else None
        if worker is not None and worker.step >= self.swarm.run.training.stop_step:
            return "its stage reached its last step"
        reason = str((worker.feed or {}).get("finished_reason", "")) if worker is not None else ""
        return reason if reason.startswith("data exhausted") else None  # a self-fed replica read all the data

    def _exited(self, slot: Slot, node, now: float) -> None:
        how = describe_exit(node.exit_code)
        finished = self._finished(slot, node)
        if slot.kind == "trainer" and self._complete:  # told to stop: the run is complete
            finished = f"stopped once every stage reached its last step ({finished or how})"
        entry = {"node": node.name, "slot": slot.name, "kind": slot.kind, "stage": slot.stage,
                 "exit_code": node.exit_code, "how": how, "restarted": False}
        self.exits.append(entry)
        if finished is not None:
            slot.settled = slot.done = True
            entry["how"] = finished
            if slot.kind == "trainer" and finished not in FINISHED_REASONS and not self._complete:
                self.early_end = self.early_end or f"{slot.name} ended early: {finished}"
                self.swarm.on_note(f"{slot.name} ended before training.max_steps: {finished}")
            return
        where = slot.stage if slot.kind == "worker" else "trainers"
        delay = self.policy.delay(slot.name)
        if delay is None:
            slot.settled = True
            self._last_exit[where] = (f"{node.name} {how}; local.max_restarts={self.policy.max_restarts} "
                                      f"restarts spent")
            alone = slot.kind == "worker" and not any(
                o.kind == "worker" and o.stage == slot.stage and (o.current.poll() is None or o.due is not None)
                for o in self.slots.values())
            consequence = (f"; stage {slot.stage} has no live worker left: the run stalls, and ends "
                           f"{self.stall.timeout_s:.0f} s after its last step (local.stall_timeout_s)") if alone else ""
            self.swarm.on_note(f"{node.name} {how}; not started again: its {self.policy.max_restarts} "
                               f"restart(s) (local.max_restarts) are spent{consequence}")
            return
        entry["restarted"] = True
        slot.due = now + delay
        self._last_exit[where] = f"{node.name} {how}; restart pending"
        self.swarm.on_note(f"{node.name} {how}; starting it again in {delay:.0f} s "
                           f"(restart {self.policy.restarts.get(slot.name, 0) + 1} of {self.policy.max_restarts})")

    def _restart(self, slot: Slot, now: float) -> None:
        count = self.policy.record(slot.name)
        name = f"{slot.name}.r{count}"
        if slot.kind == "worker":
            node = self.swarm.start_worker(slot.stage, name)
        else:
            node = self.swarm.start_trainer(slot.index, name=name)
        slot.nodes.append(node)
        slot.due = None
        self.stall.reset(now)
        self._last_exit.pop(slot.stage if slot.kind == "worker" else "trainers", None)


def _read_stats(path) -> Optional[dict]:
    import json

    try:
        return json.loads(open(path).read()) if path else None
    except (OSError, ValueError):
        return None


# -- signals -------------------------------------------------------------------------------------


class StopSignals:
    """SIGINT / SIGTERM: the first raises ``KeyboardInterrupt`` in the main thread (unless the swarm is
    already stopping: then it is only recorded); a hard bound ends everything :data:`STOP_BOUND_S` later."""

    def __init__(self, kill_everything: Callable[[], None], bound_s: float = STOP_BOUND_S):
        self.kill_everything, self.bound_s = kill_everything, bound_s
        self.signum: Optional[int] = None
        self.stopping = False
        self._previous: dict = {}

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None:
            print(f"{signal.Signals(signum).name} again: already stopping (everything is gone within "
                  f"{self.bound_s:.0f} s of the first signal)", file=sys.stderr, flush=True)
            return
        self.signum = signum
        threading.Thread(target=self._deadline, name="stop-bound", daemon=True).start()
        if not self.stopping:
            raise KeyboardInterrupt

    def _deadline(self) -> None:
        time.sleep(self.bound_s)
        print(f"the swarm did not stop within {self.bound_s:.0f} s of {self.name}: killing every process",
              file=sys.stderr, flush=True)
        try:
            self.kill_everything()
        finally:
            os._exit(128 + (self.signum or signal.SIGTERM))

