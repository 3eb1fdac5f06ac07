"""``agoractl launch swarm``: a whole run on this machine, every node its own process on loopback.

Starts a DHT seed (``launch dht``), ``local.workers_per_stage`` workers per stage and
``local.trainers`` trainers — each an ordinary ``agoractl launch ...`` subprocess in its own process
group, logging to ``<run_dir>/swarm/logs/`` — waits for readiness through the DHT records (not by
sleeping), watches the run (live on a terminal: step, loss, tokens/s, live workers per stage), and
stops every process it started when the trainers finish, on error and on Ctrl-C or SIGTERM (within
:data:`~agoractl.runtime.swarm_supervisor.STOP_BOUND_S`). While the run goes on, a
:class:`~agoractl.runtime.swarm_supervisor.Supervisor` starts exited workers and trainers again
(``local.max_restarts``) and ends a run stalled for ``local.stall_timeout_s``. Nodes write their
final stats to ``<run_dir>/swarm/nodes/``; the run report goes to ``<run_dir>/swarm-report.json``
(:mod:`agoractl.training.swarm_report`). ``<run_dir>/swarm/status.json`` is rewritten every two seconds:
the seed's multiaddrs, every node's pid, and the stages' progress (what a script needs to join or
fault-inject a running swarm). ``local.hosts``: every node on its own emulated host (:mod:`agoractl.runtime.hosts`);
``ops churn`` replaces workers through the launcher (:mod:`agoractl.runtime.churn`).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import psutil

from agoractl import storage
from agoractl.auth.node_key import NODE_KEY_ENV
from agoractl.errors import AgoraError, Interrupted, RuntimeFailure, StalledRun, UsageError
from agoractl.manifest.schema import Run
from agoractl.runtime import churn, node, node_process
from agoractl.runtime.node_process import Node
from agoractl.runtime.hosts import Hosts
from agoractl.runtime.records import SERVING_PHASES, RunRecords, WorkerRecord
from agoractl.runtime.swarm_supervisor import StopSignals, Supervisor
from agoractl.training.report import write_report
from agoractl.training.node_stats import LostTrainer, TrainerNodeStats, WorkerNodeStats
from agoractl.training.swarm_report import aggregate

REPORT_FILE = "swarm-report.json"
STATUS_S = 2.0
"""Seconds between looks at the DHT for live progress (and rewrites of status.json)."""
STOP_GRACE_S = 25.0
"""Seconds from the start of a stop until SIGKILL: the trainers get SIGTERM and up to
:data:`TRAINER_GRACE_S` of it, then the workers and the seed the rest."""
TRAINER_GRACE_S = 10.0
STALLED_GRACE_S = 5.0
"""A stalled run stops faster: nothing is in flight that a live worker could finish, so every node gets
SIGTERM at once and this long before SIGKILL (the launcher ends within ``local.stall_timeout_s`` + 10 s)."""
UTILITY_GRACE_S = 15.0
"""Seconds a utility node (the Health Monitor: one last read of the trainers' final reports) gets to stop,
between the trainers and the workers (whose grace then starts)."""


@dataclass
class Snapshot:
    """What the monitor last saw in the DHT."""

    workers: dict = field(default_factory=dict)  # stage -> {peer: WorkerRecord}
    trainers: dict = field(default_factory=dict)  # index -> TrainerRecord
    time: float = 0.0
    error: Optional[str] = None  # the last DHT read failed: why


class Swarm:
    """Starts, watches and stops one local swarm; :meth:`run` returns the run report."""

    def __init__(self, run: Run, manifest: Path, overrides: list[str],
                 on_progress: Optional[Callable[[dict], None]] = None,
                 on_note: Callable[[str], None] = lambda message: None,
                 resume: tuple[Optional[int], bool, bool] = (None, False, False), utility: Sequence[str] = (),
                 device: str = "cpu"):
        self.run, self.manifest, self.overrides = run, Path(manifest).resolve(), list(overrides)
        self.device = device
        """Every worker's torch device (``launch worker --device``)."""
        self.utility = tuple(utility)
        """Utility nodes (``launch KIND``) started right after the seed, e.g. ``health``; stopped after the
        trainers, before the workers (so the Health Monitor reads the trainers' final reports)."""
        self.on_progress, self.on_note = on_progress, on_note
        self.dir = Path(run.local.run_dir) / "swarm"
        self.nodes: list[Node] = []
        self.maddrs: list[str] = []
        self.snapshot = Snapshot()
        self.seen: dict[str, WorkerRecord] = {}  # every worker ever announced, last record
        self.dht = None
        self.records: Optional[RunRecords] = None
        self.started_training: Optional[float] = None
        self.supervisor = Supervisor(self)
        self.signals = StopSignals(self.kill_groups)
        self.resume_options = resume
        """(--resume-step, --fresh, --force): planned against the store in :meth:`prepare`."""
        self.resume_plan = None
        self.hosts: Optional[Hosts] = None
        self.peer_maddrs: set[str] = set()
        self.forking = False
        """Start nodes by forking this process (:mod:`agoractl.runtime.node_process`): the first ones only."""

    # -- processes ----------------------------------------------------------------------------

    def _argv(self, kind: str, *extra: str) -> list[str]:
        sets = [a for o in self.overrides for a in ("--set", o)]
        # Every node the launch starts begins where planned; a replacement (started by the supervisor once
        # training runs) joins as any newcomer does: state from a peer or the store's newest checkpoint
        # (--fresh would refuse the checkpoints the run has written since).
        if kind in ("worker", "trainer") and self.resume_plan is not None and self.started_training is None:
            step = self.resume_plan.step
            extra = (*extra, *(("--resume-step", str(step)) if step else ("--fresh",)),
                     *(("--force",) if self.resume_options[2] and step else ()))
        return [sys.executable, "-m", "agoractl", "launch", kind, str(self.manifest), *sets, *extra]

    def _spawn(self, name: str, kind: str, argv: list[str], stage: Optional[str] = None,
               stdout=subprocess.DEVNULL, role: Optional[str] = None) -> Node:
        log_path = self.dir / "logs" / f"{name}.log"
        if self.hosts is not None:  # its own emulated host: listen on and announce that host's address
            host = self.hosts.add(name, kind, role, stage)
            argv = host.wrap(argv + host.sets())
        env = {**os.environ, node.PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        if kind in ("worker", "trainer"):  # one key per slot: a restarted node keeps its metrics instance
            env[NODE_KEY_ENV] = str(self.dir / "keys" / f"{name.split('.r', 1)[0]}.key")
        # Once this process imported the node code (start_seed), the first workers and trainers are forked from it.
        # Not the seed (it starts first) nor utility nodes (their stacks are others; the Health Monitor and the
        # Dashboard, started together in no time, raced on their database's migrations).
        fork = self.forking and kind in ("worker", "trainer")
        proc = node_process.start(argv, env, log_path, fork=fork, stdout=stdout)
        n = Node(name, kind, proc, log_path, stage=stage)
        self.nodes.append(n)
        return n

    def start_seed(self, timeout_s: float) -> list[str]:
        seed = self._spawn("dht", "dht", self._argv("dht", "--json"), stdout=subprocess.PIPE)
        lines: queue.Queue = queue.Queue()

        def read():
            for line in seed.proc.stdout:
                lines.put(line.decode(errors="replace"))
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        if self.hosts is None and node_process.enabled():  # while the seed starts, import what every node imports
            node_process.warm()
            self.forking = True
        text, deadline = "", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            text += line
            try:
                return list(json.loads(text)["maddrs"])
            except (json.JSONDecodeError, KeyError):
                continue
        raise RuntimeFailure(f"the DHT seed did not start within {timeout_s:.0f} s (exit code {seed.poll()}): "
                             f"{seed.log_tail(3)}", hint=f"see {seed.log_path}")

    def start_worker(self, stage: str, name: str) -> Node:
        stats = self.dir / "nodes" / f"{name}.json"
        role = churn.worker_role(name, self.run.local.workers_per_stage, self.run.local.hosts.contributors_per_stage)
        n = self._spawn(name, "worker", self._argv("worker", "--stage", stage, "--stats", str(stats), "--role", role,
                                                   "--device", self.device, *self._peer_args()), stage=stage, role=role)
        n.stats_path = stats
        return n

    def start_trainer(self, index: int, name: Optional[str] = None) -> Node:
        name = name or f"trainer-{index}"
        stats = self.dir / "nodes" / f"{name}.json"
        # The launcher watches the whole run for stalls (local.stall_timeout_s) and restarts what died:
        # a trainer of its own giving up on a stage meanwhile would only cost a restart.
        n = self._spawn(name, "trainer", self._argv("trainer", "--index", str(index), "--stats", str(stats),
                                                    "--set", "trainers.stall_timeout_s=0",
                                                    "--min-workers", str(self.run.local.start_with_workers
                                                                         or self.run.local.workers_per_stage),
                                                    *self._peer_args()))
        n.stats_path = stats
        return n

    def _restart_utility(self) -> None:
        """A utility node that exited mid-run (killed, crashed) is started again at once (it keeps no state of its
        own: the Health Monitor's is in its database)."""
        for kind in self.utility:
            runs = [n for n in self.nodes if n.kind == kind]
            if runs and runs[-1].poll() is not None:
                self.on_note(f"{runs[-1].name} exited with code {runs[-1].exit_code}; starting it again")
                self._spawn(f"{kind}.r{len(runs)}", kind, self._argv(kind, *node.utility_args(kind, self._peer_args())))

    def _peer_args(self) -> list[str]:
        return [a for m in self.maddrs for a in ("--initial-peers", m)]

    def stop_all(self, stalled: bool = False) -> None:
        """SIGTERM every node we started (the node itself: it stops its DHT process and p2pd in order) —
        trainers first, so their in-flight samples finish on live workers, then utility nodes (the Health
        Monitor), then workers and the seed —
        then SIGKILL each node's whole process group, whatever is left of it after the grace period.
        A `stalled` run has nothing in flight: every node at once, :data:`STALLED_GRACE_S` of grace."""
        order = ((("trainer", "worker", "dht", *self.utility), STALLED_GRACE_S),) if stalled else (
            (("trainer",), TRAINER_GRACE_S), (self.utility, UTILITY_GRACE_S),
            (("worker", "dht"), STOP_GRACE_S - TRAINER_GRACE_S))
        for kinds, grace_s in order:
            deadline = time.monotonic() + grace_s
            alive = [n for n in self.nodes if n.kind in kinds and n.poll() is None]
            for n in alive:
                try:
                    n.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            for n in alive:
                try:
                    n.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self.kill_groups()

    def kill_groups(self) -> None:
        """SIGKILL every node's process group (DHT children and p2pd of a node killed earlier too), and any
        child that leads its own group (a node started while a signal struck, before it was recorded)."""
        pids = {n.proc.pid for n in self.nodes}
        try:
            pids |= {c.pid for c in psutil.Process().children() if os.getpgid(c.pid) == c.pid}
        except (psutil.Error, OSError):
            pass
        for pid in pids:
            node_process.signal_group(pid, signal.SIGKILL)
        reaped = time.monotonic() + 2.0  # the exit codes in the report: SIGKILL takes a moment to land
        for n in self.nodes:
            if n.poll() is None:
                try:
                    n.proc.wait(max(0.01, reaped - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                n.poll()

    # -- monitoring ---------------------------------------------------------------------------

    def observe(self) -> Snapshot:
        snap = Snapshot(time=time.time())
        for s in self.run.stage_names():
            try:
                snap.workers[s] = self.records.stage_workers(s)
            except Exception as e:
                snap.workers[s] = self.snapshot.workers.get(s, {})
                snap.error = f"{type(e).__name__}: {e}"[:200]
            for peer, rec in snap.workers[s].items():
                self.seen[peer] = rec
        try:
            snap.trainers = self.records.trainers()
        except Exception as e:
            snap.trainers = self.snapshot.trainers
            snap.error = f"{type(e).__name__}: {e}"[:200]
        self.snapshot = snap
        return snap

    def status(self) -> dict:
        snap = self.snapshot
        stages = {}
        for s in self.run.stage_names():
            recs = snap.workers.get(s, {})
            stages[s] = {"live": sum(r.phase in SERVING_PHASES for r in recs.values()),
                         "step": max([0, *(r.step for r in recs.values())]),
                         "samples": sum(r.samples for r in recs.values()),
                         "max_coalesced": max([0, *(r.max_coalesced for r in recs.values())])}
        losses = [t.loss for t in snap.trainers.values() if t.loss is not None]
        # The slowest stage's step, among stages with a record (a stage whose workers all died rejoins later).
        steps = min([v["step"] for s, v in stages.items() if snap.workers.get(s)] or [0])
        elapsed = time.time() - self.started_training if self.started_training else 0.0
        return {
            "maddrs": self.maddrs, "launcher_pid": os.getpid(),
            **({"hosts": self.hosts.describe(), "peer_maddrs": sorted(self.peer_maddrs)} if self.hosts else {}),
            "nodes": churn.node_status(self.nodes, snap),
            "stages": stages, "step": steps, "max_steps": self.run.training.max_steps,
            "until_step": self.run.training.until_step,
            "loss": sum(losses) / len(losses) if losses else None,
            "tokens_per_s": steps * self.run.training.global_batch_size * self.run.model.seq_len / elapsed
            if elapsed > 0 else 0.0,
            "completed_samples": sum(t.completed for t in snap.trainers.values()),
            "lost_samples": sum(t.lost for t in snap.trainers.values()),
            "restarts": self.supervisor.restarts(),
        }

    def _write_status(self, status: dict) -> None:
        storage.write_bytes_atomic(str(self.dir / "status.json"), (json.dumps(status, indent=2) + "\n").encode())

    def _wait_for_workers(self, timeout_s: float) -> None:
        want = self.run.local.workers_per_stage
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_nodes(kinds=("dht", "worker", "trainer"))
            snap = self.observe()
            live = {s: sum(r.phase in SERVING_PHASES for r in snap.workers[s].values()) for s in snap.workers}
            self._write_status(self.status())
            if all(v >= want for v in live.values()):
                return
            time.sleep(0.5)
        raise RuntimeFailure(f"workers did not all announce themselves within {timeout_s:.0f} s",
                             hint=f"see the logs in {self.dir / 'logs'}; raise network.startup_timeout_s "
                                  "on a loaded machine")

    def _check_nodes(self, kinds: tuple[str, ...]) -> None:
        for n in self.nodes:
            if n.kind in kinds and n.poll() is not None:
                raise RuntimeFailure(f"{n.name} exited with code {n.exit_code} during start-up: {n.log_tail(3)}",
                                     hint=f"see {n.log_path}")

    # -- the run ------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Check the data before starting anything (a missing shard index fails here, in one line) and reset
        the swarm directory. Trainers claim their shards themselves (the shard ledger in data.output)."""
        from agoractl.data.claim_store import claim_store
        from agoractl.data.index import read_index

        if self.run.local.trainers > self.run.trainers.count:
            raise UsageError(f"local.trainers ({self.run.local.trainers}) exceeds trainers.count "
                             f"({self.run.trainers.count})", hint="set trainers.count to at least local.trainers")
        read_index(self.run.data.output)
        claim_store(self.run.data.output)  # the shard ledger needs atomic claims: a local path or s3://
        from agoractl.ops import resume

        self.resume_plan = resume.plan(self.run, None, None, *self.resume_options)
        self.on_note(f"swarm: {self.resume_plan.describe()}")
        for sub in ("logs", "nodes"):
            shutil.rmtree(self.dir / sub, ignore_errors=True)
            (self.dir / sub).mkdir(parents=True, exist_ok=True)

    def run_swarm(self) -> dict:
        """Start everything, train to the end, stop everything; returns the run report (also written)."""
        startup = self.run.network.startup_timeout_s
        self.prepare()
        t_begin = time.time()
        interrupted, failure = False, None
        try:
            self.signals.install()  # inside the try: a signal right after it still stops what started
            if self.run.local.hosts.enabled:
                self.hosts = Hosts(self.run.local.hosts, log_dir=str(self.dir / "logs")).open()
            self.maddrs = self.start_seed(startup * 2)
            self.on_note(f"DHT seed up in {time.time() - t_begin:.1f} s: {self.maddrs[0] if self.maddrs else ''}")
            for kind in self.utility:
                self._spawn(kind, kind, self._argv(kind, *node.utility_args(kind, self._peer_args())))
            for s in self.run.stage_names():
                for i in range(self.run.local.workers_per_stage):
                    self.start_worker(s, f"worker-{s}-{i}")
            # Trainers start now too (their start-up overlaps the workers'); each waits until every
            # stage has local.workers_per_stage live workers before its first sample.
            trainers = [self.start_trainer(i) for i in range(self.run.local.trainers)]
            # The launcher's own DHT client (it watches the run's records) starts while the nodes start.
            self.forking = False  # from here on this process runs threads a fork must not copy half-done
            self.dht = node.start_dht(self.hosts.launcher_run(self.run) if self.hosts else self.run, self.maddrs,
                                      client_mode=True)
            self.records = RunRecords(self.dht, self.run.metadata.name)
            self._wait_for_workers(startup * 3)
            self.on_note(f"{sum(n.kind == 'worker' for n in self.nodes)} workers up in {time.time() - t_begin:.1f} s "
                 f"(logs in {self.dir / 'logs'})")
            self.started_training = time.time()
            self.supervisor.adopt()
            self._watch(trainers)
        except KeyboardInterrupt:
            interrupted = True
        except AgoraError as e:  # a stall, every trainer failed, a start-up failure: reported, then raised
            failure = e
        finally:
            self.signals.stopping = True  # from here on a signal is only recorded: this stop is bounded
            t_stop = time.monotonic()
            self.stop_all(stalled=isinstance(failure, StalledRun))  # _watch took the last look at the DHT
            if self.dht is not None:
                node.shutdown_dht(self.dht)
            if self.hosts is not None:
                self.hosts.close()
        report = self.report(fallback_elapsed_s=time.time() - (self.started_training or t_begin),
                             interrupted=interrupted or self.signals.signum is not None)
        report["end_reason"] = self._end_reason(report, failure)
        report["resume"] = self.resume_plan.as_dict() if self.resume_plan is not None else None
        report["report_path"] = write_report(self.run.local.run_dir, REPORT_FILE, report)
        self.signals.restore()
        if self.signals.signum is not None:
            raise Interrupted(self.signals.signum, f"{report['end_reason']}: every process of the swarm stopped in "
                                                   f"{time.monotonic() - t_stop:.1f} s; report {report['report_path']}")
        if interrupted:  # a KeyboardInterrupt not from our handlers (not installed off the main thread)
            raise KeyboardInterrupt
        if failure is not None:
            raise failure
        if not report["completed"] and not report["end_reason"].startswith("data exhausted"):
            raise RuntimeFailure(f"the run ended before training.max_steps: {report['end_reason']}",
                                 hint=f"see the trainers' logs in {self.dir / 'logs'}; report {report['report_path']}")
        return report

    def _end_reason(self, report: dict, failure: Optional[AgoraError]) -> str:
        """Why the run ended, in one line: `max_steps reached (step N)`, `data exhausted after E epoch(s) at
        step N of M`, `interrupted by SIGINT`, `stalled: ...` or another failure's message."""
        if self.signals.signum is not None:
            return f"interrupted by {self.signals.name}"
        if report.get("interrupted"):
            return "interrupted"
        if failure is not None:
            return failure.message
        if report.get("completed"):
            if self.run.training.until_step:
                return f"until_step reached (step {report['steps']})"
            return f"max_steps reached (step {report['steps']})"
        early = self.supervisor.early_end or "the trainers ended before training.max_steps"
        exhausted = [e["how"] for e in self.supervisor.exits if e["kind"] in ("trainer", "worker")
                     and str(e["how"]).startswith("data exhausted")]
        if exhausted:
            return f"{exhausted[0]} at step {report['steps']} of {self.run.training.max_steps}"
        return early

    def _watch(self, trainers: list[Node]) -> None:
        last_status = 0.0
        while True:
            self.supervisor.tick()  # exited nodes started again; StalledRun when nothing moves
            self._restart_utility()
            churn.serve_requests(self)  # `ops churn`: replace a worker now
            # Self-fed replicas (workers.self_feed) read their own samples: the run ends when they end.
            trainers = self.supervisor.workers() if self.run.workers.self_feed else self.supervisor.trainers()
            done = [t for t in trainers if self.supervisor.settled(t)]
            if time.monotonic() - last_status >= STATUS_S or len(done) == len(trainers):
                last_status = time.monotonic()
                self.observe()
                if self.hosts is not None:
                    churn.observe_peers(self)
                status = self.status()
                self._write_status(status)
                if self.on_progress is not None:
                    self.on_progress(status)
            if len(done) == len(trainers):
                failed = [t for t in done if t.exit_code != 0]
                if failed and len(failed) == len(trainers):
                    raise RuntimeFailure(f"every {'replica' if self.run.workers.self_feed else 'trainer'} failed; "
                                         f"{failed[0].name} exited with code "
                                         f"{failed[0].exit_code}: {failed[0].log_tail(3)}",
                                         hint=f"see the logs in {self.dir / 'logs'}")
                return
            time.sleep(0.2)

    def report(self, fallback_elapsed_s: float, interrupted: bool = False) -> dict:
        workers: list[WorkerNodeStats] = []
        trainers: list[TrainerNodeStats] = []
        exits = {}
        for n in self.nodes:
            stats = _read_json(n.stats_path) if n.stats_path else None
            exits[n.name] = n.exit_code
            if stats is not None and n.kind == "worker":
                workers.append(WorkerNodeStats.from_dict(stats))
                if workers[-1].feed is not None:  # a self-fed replica's feeder counts as its trainer
                    trainers.append(TrainerNodeStats.from_dict(workers[-1].feed))
            elif stats is not None and n.kind == "trainer":
                trainers.append(TrainerNodeStats.from_dict(stats))
        have = {w.peer for w in workers}
        for peer, rec in self.seen.items():  # killed workers: their last DHT record stands in
            if peer not in have:
                workers.append(WorkerNodeStats(
                    peer=rec.peer, stage=rec.stage, phase=rec.phase, role=rec.role, step=rec.step,
                    backward_samples=rec.samples, max_coalesced=rec.max_coalesced, throughput=rec.throughput,
                    pid=rec.pid, started=rec.started, first_request=rec.first_request, killed=True))
        written = {t.trainer for t in trainers}
        lost_trainers = [LostTrainer(index, rec.in_flight) for index, rec in self.snapshot.trainers.items()
                         if index not in written]
        report = aggregate(self.run, workers, trainers, lost_trainers, fallback_elapsed_s,
                           interrupted=interrupted, exit_codes=exits,
                           processes={"workers_per_stage": self.run.local.workers_per_stage,
                                      "trainers": self.run.local.trainers,
                                      "threads_per_process": self.run.local.threads_per_process},
                           restarts=self.supervisor.restarts(), node_exits=self.supervisor.exits,
                           launched=node_process.started_at())  # the `agoractl launch swarm` process
        for s in report["stages"]:
            s["restarts"] = self.supervisor.stage_restarts(s["name"])
        report["churn"] = churn.events(self)
        if self.hosts is not None:
            report["hosts"] = {"hosts": self.hosts.describe(), "peer_maddrs": sorted(self.peer_maddrs)}
        return report


def _read_json(path: Optional[Path]) -> Optional[dict]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError, TypeError):
        return None
