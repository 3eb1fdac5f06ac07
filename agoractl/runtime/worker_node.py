"""A worker process (``agoractl launch worker``): the :class:`~agoractl.training.worker.Worker` compute,
connected to the DHT and libp2p (report §3.3.1).

Three threads:

- the **compute loop** (the caller's thread): queues, coalescing, forward/backward, stepping;
- the **connection handler**: an asyncio loop on a P2P replica of the DHT's daemon serving the stage's
  RPCs (:mod:`agoractl.runtime.transport`); each request becomes a :class:`Task` on a queue and its
  reply is sent when the compute loop resolves it;
- the **DHT thread**: re-announces the worker under its stage-prefixed key every
  ``workers.announce_period_s`` (expiry three periods, report §3.3.1.5), publishes its
  ``(step, samples)`` whenever they change and fetches its stage peers' progress, so the replicas
  step together (:mod:`agoractl.algorithms.progress`); with ``workers.progress_push`` it also pushes the changes
  straight to the stage's replicas. The connection handler takes in the pushes of any replica that sends them
  (:mod:`agoractl.runtime.progress_push`).
  Every DHT call is made from this thread only.

``--stage auto`` joins the stage with the fewest live replicas (ties: the earliest stage). A worker
that joins a running stage starts at the stage's current step. Once the stage reached
``training.max_steps`` and no request came for :data:`FINISHED_IDLE_S` seconds, the worker exits. With
``workers.self_feed`` a whole-model replica reads its own samples (:mod:`agoractl.training.self_feed`, no trainer)
and exits once it trained them and took its last step (or the data ran out).

The node builds the stage's averaging transport (:func:`~agoractl.runtime.averaging.stage_averager`,
an averager process, set from the method's manifest section; with admission on
:func:`~agoractl.runtime.averaging_auth.admitted_averager`, whose RPCs check credentials) and injects it into the data-parallel
method (:class:`~agoractl.training.data_parallel.DataParallelMethod`, ``self.data_parallel``): with
``data_parallel.method: sparta`` a :class:`~agoractl.runtime.sparta_worker.SpartaWorker` loads a
joining worker's state, runs its sync phases and the stage's averaging rounds; with ``fgdiloco`` a
:class:`~agoractl.runtime.fgdiloco_worker.FGDiLoCoNode` runs the stage's outer rounds instead, and with
``data_parallel.fgdiloco.transport: direct`` (the default) no averager is started: its mixes and joining state go
over :mod:`agoractl.runtime.direct_mixing` (credentials checked there when admission is on).
Every worker runs the self-termination rules (:class:`~agoractl.training.self_termination.Monitor`)
on its events: when one fires the worker stops and the process exits with the rule's code.
"""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import threading
import time
from typing import Optional, Sequence

import torch

from agoractl import logs
from agoractl.auth import node_key
from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.schema import Run
from agoractl.runtime import admission, node
from agoractl.runtime.averaging import stage_averager
from agoractl.runtime.averaging_auth import admitted_averager
from agoractl.runtime.direct_mixing import direct_mixing
from agoractl.runtime.fgdiloco_worker import FGDiLoCoNode
from agoractl.runtime.metrics import NodeMetrics, worker_sample
from agoractl.runtime.progress_push import ProgressPush
from agoractl.training.pipeline_writes import PipelineWrites
from agoractl.runtime.records import PHASES, SERVING_PHASES, RunRecords, WorkerRecord
from agoractl.training.self_feed import SelfFeed
from agoractl.runtime.sparta_worker import SpartaWorker
from agoractl.algorithms.progress import PeerProgress, run_position
from agoractl.algorithms.termination import Termination
from agoractl.training.data_parallel import DataParallelMethod, transport_capacity
from agoractl.training.node_stats import WorkerNodeStats
from agoractl.training.self_termination import Monitor
from agoractl.runtime.transport import StageServicer, namespace
from agoractl.training.fault_drill import FAULTS
from agoractl.training.worker import Task, Worker

FINISHED_IDLE_S = 10.0
"""A worker whose stage finished exits after this many seconds without requests."""
PROGRESS_PEERS_S = 0.5
"""With replicas in the stage: seconds between fetches of their progress, and least seconds between
publications of a changed sample count (a new step is published at once). Alone, both happen once per
announce period: only newcomers read the record then. Every fetch or publication is a DHT traversal
(p2pd round trips to several nodes): at 0.1 s a 3 x 2 test swarm on 2 cores spent about half its CPU on
them, and at 0.25 s a 2 x 3 SPARTA swarm still spent more on its DHT processes and p2pd daemons than on
training; at 0.5 s the stage's step lag stays far below one step of a real run (cumulative counts keep
the samples per step right on average whatever the lag, :mod:`agoractl.algorithms.progress`)."""


def choose_stage(live: dict[str, int], order: Sequence[str]) -> str:
    """`--stage auto`: the stage with the fewest live replicas; ties go to the earliest stage."""
    return min(order, key=lambda s: (live.get(s, 0), order.index(s)))


DEFAULT_GC_THRESHOLDS = (700, 10, 10)
"""CPython's collector thresholds, restored once the worker is ready (the CLI raises them for start-up)."""


class WorkerNode:
    """One worker process: DHT node, connection handler, compute loop."""

    def __init__(self, run: Run, stage: str, initial_peers: Sequence[str], role: str = "operator",
                 device: str = "cpu", stats_path: Optional[str] = None, phase: str = "active",
                 fault: Optional[str] = None, resume_step: Optional[int] = None, fresh: bool = False,
                 force: bool = False):
        if role not in ("operator", "contributor"):
            raise UsageError(f"--role {role}: choose operator or contributor")
        if fault is not None and fault not in FAULTS:
            raise UsageError(f"--fault {fault}: choose one of {', '.join(FAULTS)}")
        if phase not in PHASES:
            raise UsageError(f"phase {phase}: choose one of {', '.join(PHASES)}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UsageError(f"--device {device}: CUDA is not available on this machine", hint="use --device cpu")
        if stage != "auto" and stage not in run.stage_names():
            raise UsageError(f"--stage {stage}: no such stage; stages are {', '.join(run.stage_names())} (or auto)")
        self.run, self.stats_path = run, stats_path
        self.period = run.workers.announce_period_s
        self.stop = threading.Event()
        self.log = logs.get("worker")
        self.dht = node.start_dht(run, node.require_peers(initial_peers, "worker"))
        self.records = RunRecords(self.dht, run.metadata.name)
        self.peer = self.dht.peer_id.to_base58()
        self.admitted = admission.enter(run, self.dht, "worker")  # None when admission is off
        if self.admitted is not None and self.admitted.stage:
            stage = self.admitted.stage  # placement belongs to the Authorizer (report §3.6.1.4)
        if stage == "auto":
            names = run.stage_names()
            live = {s: sum(r.phase in SERVING_PHASES for r in self.records.stage_workers(s).values()) for s in names}
            stage = choose_stage(live, names)
        self.stage = stage
        index = run.stage_names().index(stage)
        joined_at = max([0, *(p.step for p in self.records.stage_progress(stage).values())])
        self.resumed = None
        """A stage not running yet starts from the store (the run restarts: agoractl.training.stage_resume)."""
        # No replica of the stage left while the others train on: rejoin at the run's step (an explicit
        # --resume-step / --fresh is a launch's plan, not a replacement's).
        position = (None if joined_at or resume_step is not None or fresh
                    else run_position(p for s in run.stage_names() if s != stage
                                      for p in self.records.stage_progress(s).values()))
        from agoractl.training.stage_resume import rejoin_stage, resume_stage

        if joined_at:
            self.log.info("joining a running stage", stage=stage, step=joined_at)
        if joined_at and run.data_parallel.method == "none" or position is not None:
            try:  # a pure pipeline's stage has no averager to serve a peer's state: the store's newest
                self.resumed = (rejoin_stage(run, stage, joined_at, 0, action="join") if joined_at
                                else rejoin_stage(run, stage, position.step, position.seen))
            except BaseException:
                node.shutdown_dht(self.dht)
                raise
            if position is not None:
                self.log.warning("stage had no live replica: rejoining at the run's step", stage=stage,
                                 **self.resumed.facts())
        elif not joined_at:
            try:
                self.resumed = resume_stage(run, stage, resume_step, fresh, force)
            except BaseException:
                node.shutdown_dht(self.dht)
                raise
            self.log.info("stage state", stage=stage, **self.resumed.facts())
        self.worker = Worker(run, index, device, step=joined_at or self.resumed.step, phase=phase, role=role,
                             restarts=not joined_at,  # the stage resumes from the store: it counts from there
                             seen=position.seen if position is not None else None)
        if self.resumed is not None:
            self.resumed.apply(self.worker)
        self.worker.fault = fault
        if fault:
            self.log.warning("fault drill: this worker's outputs are wrong on purpose", fault=fault)
        if self.admitted is not None:
            self.admitted.step = lambda: self.worker.progress.step
        self.termination: Optional[Termination] = None
        """The self-termination rule that fired (report §3.3.1.6), if one did."""
        self.monitor = Monitor(run.workers.self_termination, self._terminate)
        self.worker.listeners.append(self.monitor)
        self.data_parallel: Optional[DataParallelMethod] = None
        if run.data_parallel.method != "none":  # one averaging transport, whichever method runs on it
            capacity = transport_capacity(run, self.worker.module)
            direct = run.data_parallel.method == "fgdiloco" and run.data_parallel.fgdiloco.transport == "direct"
            if direct:  # the direct transport serves joining state itself: no averager process
                averager = None
            elif self.admitted is None:
                averager = stage_averager(run, stage, role, self.dht, capacity)
            else:  # its RPCs check peers' credentials
                averager = admitted_averager(run, stage, role, self.dht, capacity, self.admitted)
            if run.data_parallel.method == "sparta":  # averaging rounds, joining state, sync phases
                self.data_parallel = SpartaWorker(run, self.worker, averager, self.dht, self.records, self.peer)
            elif direct:  # fgdiloco over direct pushes: outer rounds, joining state; no averager process
                self.data_parallel = FGDiLoCoNode(run, self.worker, self.records, self.peer, direct=lambda peers:
                                                  direct_mixing(run, stage, self.dht, peers, capacity, self.admitted))
            else:  # fgdiloco over hivemind's averager: outer rounds, joining state
                self.data_parallel = FGDiLoCoNode(run, self.worker, self.records, self.peer, averager=averager)
            self.data_parallel.join(joined_at)
            if self.resumed is not None and isinstance(self.data_parallel, FGDiLoCoNode):
                self.data_parallel.rounds.restore(self.resumed.outer_state(), self.resumed.step)
        else:  # a pure pipeline: checkpoints only
            self.data_parallel = PipelineWrites(run, self.worker, self.peer)
        if self.resumed is not None and (self.resumed.checkpoint is not None or position is not None or joined_at):
            self.data_parallel.join_facts = self.resumed.facts()
        self.feed: Optional[SelfFeed] = None
        """``workers.self_feed``: the replica reads its own samples (validation: FGDiLoCo replicas, so peers exist)."""
        if run.workers.self_feed:
            self.feed = SelfFeed(run, self.worker, self.peer, self.data_parallel.peers.live_ids, self.stop)
        self.metrics = NodeMetrics(run, "worker", stage, node_key.instance_id(node_key.load_or_create()),
                                   worker_sample(self))
        self.worker.listeners.append(self.metrics)
        self.started = time.time()
        self.cpu_at_ready: dict = {}
        self.cpu_at_first_request: Optional[dict] = None
        self.dht_calls: dict[str, list] = {}
        """{DHT call: [count, seconds]}, for profiles."""
        self.announced: Optional[float] = None
        """Wall-clock time of the first successful announcement (when trainers can first see it)."""
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.progress_push = ProgressPush(f"{namespace(run.metadata.name, stage)}.progress", self.worker.progress.heard,
                                          gate=(self.admitted.auth.gate_replica(stage, "progress_push")
                                                if self.admitted is not None else None),
                                          token=self.admitted.current if self.admitted is not None else lambda: None)
        """This replica's progress, pushed straight to the stage's other replicas (theirs taken in)."""
        self._served_ready = threading.Event()
        self._serve_stop = threading.Event()
        """Set once the worker withdrew from the DHT: the connection handler then stops listening."""
        self._serve_error: Optional[BaseException] = None
        logs.bind(run=run.metadata.name, role="worker", stage=stage, peer=self.peer[-8:])

    def _terminate(self, termination: Termination) -> None:
        """A self-termination rule fired: stop serving; the caller exits with the rule's code."""
        self.termination = termination
        self.stop.set()

    # -- connection handler -------------------------------------------------------------------

    async def _handle(self, method: str, tensors: dict, meta: dict, caller: str):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def resolve(result, error):
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(result)

        def done(result, error):
            loop.call_soon_threadsafe(resolve, result, error)

        if method == "notice":  # a trainer rejected one of our outputs (rule refused_outputs)
            self.worker.emit("refused", trainer=caller, reason=str(meta.get("reason", ""))[:200], time=time.monotonic())
            return {}, {}
        if "ids" not in tensors:
            raise ValueError("a stage request carries the sample's token ids ('ids')")
        self.worker.submit(Task(method, tensors["ids"], tensors.get("wire"), tensors.get("grad"), done))
        result = await fut
        out = {k: v for k, v in result.items() if isinstance(v, torch.Tensor)}
        return out, {k: v for k, v in result.items() if not isinstance(v, torch.Tensor)}

    def _serve(self) -> None:
        self.loop = loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def main():
            try:
                p2p = await self.dht.replicate_p2p()
                servicer = StageServicer(self._handle, self.admitted.auth.gate_stage(self.stage)
                                         if self.admitted is not None else None)
                await servicer.add_p2p_handlers(p2p, namespace=namespace(self.run.metadata.name, self.stage))
                await self.progress_push.open(p2p)
            except BaseException as e:
                self._serve_error = e
                self._served_ready.set()
                self.stop.set()
                self._serve_stop.set()
                return
            self._served_ready.set()
            while not self._serve_stop.is_set():
                await asyncio.sleep(0.1)
            try:
                await self.progress_push.close()
                await servicer.remove_p2p_handlers(p2p, namespace=namespace(self.run.metadata.name, self.stage))
            except Exception:
                pass

        loop.run_until_complete(main())

    # -- DHT thread ---------------------------------------------------------------------------

    def record(self) -> WorkerRecord:
        w, s = self.worker, self.worker.stats
        return WorkerRecord(peer=self.peer, stage=self.stage, phase=w.phase, role=w.role, step=w.progress.step,
                            samples=s.backward_samples, throughput=round(w.throughput, 3),
                            max_coalesced=s.max_coalesced, queued=w.queued(), pid=os.getpid(),
                            started=self.started, first_request=s.first_request, round=w.averaging_round)

    def _dht_call(self, fn, *args):
        t0 = time.monotonic()
        try:
            out = fn(*args)
            self.worker.emit("dht", ok=True, time=time.monotonic())
            calls = self.dht_calls.setdefault(fn.__name__, [0, 0.0])
            calls[0] += 1
            calls[1] += time.monotonic() - t0
            return out
        except Exception as e:
            self.worker.emit("dht", ok=False, time=time.monotonic(), error=f"{type(e).__name__}: {e}")
            return None

    def _sync(self) -> None:
        """Announce, publish progress, fetch the peers' progress. Stores do not block the loop (a DHT store
        is a traversal, hundreds of milliseconds on a loaded machine): one of each kind is in flight at most."""
        progress, ttl = self.worker.progress, 3 * self.period
        next_announce = next_fetch = last_publish = 0.0
        last_published, last_pushed, first_work = None, None, True
        push = self.run.workers.progress_push
        pending: dict[str, tuple] = {}  # kind -> (future, started, on success)

        def settle() -> None:
            for kind, (future, started, on_success) in list(pending.items()):
                if not future.done():
                    if time.monotonic() - started > self.records.timeout_s:
                        future.cancel()
                        del pending[kind]
                        self.worker.emit("dht", ok=False, time=time.monotonic(), error=f"{kind} timed out")
                    continue
                del pending[kind]
                try:
                    ok = future.result()
                except Exception as e:
                    self.worker.emit("dht", ok=False, time=time.monotonic(), error=f"{type(e).__name__}: {e}")
                    continue
                self.worker.emit("dht", ok=True, time=time.monotonic())
                calls = self.dht_calls.setdefault(kind, [0, 0.0])
                calls[0] += 1
                calls[1] += time.monotonic() - started
                if ok and on_success is not None:
                    on_success()

        def store(kind: str, fn, *args, on_success=None, **kwargs) -> None:
            try:
                pending[kind] = (fn(*args, wait=False, **kwargs), time.monotonic(), on_success)
            except Exception as e:
                self.worker.emit("dht", ok=False, time=time.monotonic(), error=f"{type(e).__name__}: {e}")

        def announced() -> None:
            if self.announced is None:
                self.announced = time.time()

        while not self.stop.is_set():
            settle()
            if self.cpu_at_first_request is None and self.worker.stats.first_request is not None:
                self.cpu_at_first_request = node.cpu_seconds()  # profiles count from the first request
            now = time.monotonic()
            if now >= next_announce and "announce" not in pending:
                store("announce", self.records.announce_worker, self.record(), ttl, on_success=announced)
                next_announce = now + self.period
            mine = (progress.step, progress.total)
            # Peers need our count soon (they step on it) and a new step at once; alone, or stepping on its own
            # count, only newcomers and the checkpoint publisher's choice read it: once per announce period.
            collective = progress.peers and not progress.own
            publish_every = PROGRESS_PEERS_S if collective else self.period
            due = (last_published is None
                   or (collective and mine[0] != last_published[0])
                   or (mine != last_published and now - last_publish >= publish_every)
                   or now - last_publish >= self.period)  # refresh before the record expires
            if collective and push and mine != last_pushed:  # the replicas step on it: at once, straight to them
                last_pushed = mine
                self.progress_push.push(progress.peers, PeerProgress(*mine, seen=progress.stage_total()))
            if due and "progress" not in pending:
                last_publish, last_published = now, mine
                store("progress", self.records.publish_progress, self.stage, self.peer, mine[0], mine[1], ttl,
                      seen=progress.stage_total())
            if first_work and self.worker.stats.first_request is not None:
                # Trainers send work once the stage's workers are in the DHT: read them now, not an announce
                # period later (whole-model replicas each took the whole batch for their first 2 s of steps).
                first_work, next_fetch = False, now
            if now >= next_fetch:
                peers = self._dht_call(self.records.stage_progress, self.stage)
                if peers is not None:
                    peers.pop(self.peer, None)
                    progress.observe(peers)
                next_fetch = time.monotonic() + (PROGRESS_PEERS_S if collective else self.period)
            self.worker.progress_changed.wait(0.05)
            self.worker.progress_changed.clear()

    # -- lifecycle ----------------------------------------------------------------------------

    def serve(self) -> dict:
        """Run until stopped (signal, parent gone, or the stage finished and idle); returns the stats."""
        node.stop_on_signals(self.stop)
        node.watch_parent(self.stop)
        server = threading.Thread(target=self._serve, name="connection-handler", daemon=True)
        server.start()
        self._served_ready.wait()
        if self._serve_error is not None:
            node.shutdown_dht(self.dht)
            raise self._serve_error
        sync = threading.Thread(target=self._sync, name="dht-sync", daemon=True)
        sync.start()
        self.monitor.start(self.stop)
        if self.data_parallel is not None:
            self.data_parallel.start()
        if self.feed is not None:
            self.feed.start()
        self.cpu_at_ready = node.cpu_seconds()
        metrics_url = self.metrics.start(self.admitted.current if self.admitted is not None else lambda: None)
        if metrics_url:
            self.log.info("metrics served", url=metrics_url, instance=self.metrics.labels["instance"])
        gc.freeze()  # start-up's objects live as long as the process: keep them out of every collection
        gc.set_threshold(*DEFAULT_GC_THRESHOLDS)  # the CLI raised gen 0's for start-up
        self.log.info("worker ready", stage=self.stage, step=self.worker.progress.step,
                      peer=self.peer, pid=os.getpid())
        last_work, optimizer_built = time.monotonic(), False
        try:
            while not self.stop.is_set():
                if self.worker.run_once(0.05):
                    last_work = time.monotonic()
                    if self._fed_all():
                        self.log.info("fed and trained every batch; worker exits", step=self.worker.progress.step)
                        break
                elif not optimizer_built:  # first idle moment: while trainers discover us (torch._dynamo's import)
                    self.worker.build_optimizer()
                    optimizer_built = True
                elif self.feed is not None and self.feed.ended.is_set():  # idle: its last step is taken too
                    self.log.info("the feeder ended; worker exits", step=self.worker.progress.step,
                                  reason=self.feed.summary()["finished_reason"])
                    break
                elif self.worker.progress.finished and time.monotonic() - last_work > FINISHED_IDLE_S:
                    self.log.info("stage finished; worker exits", step=self.worker.progress.step)
                    break
        finally:
            # Leave in order: refuse new work, withdraw the record, then stop listening, so that trainers
            # get a clear error (and retry elsewhere) rather than a protocol the daemon no longer knows.
            self.stop.set()
            self.worker.fail_pending(RuntimeError(f"worker of stage {self.stage} is shutting down"))
            self._dht_call(self.records.withdraw_worker, self.stage, self.peer)
            self._serve_stop.set()
            self.metrics.stop()
            sync.join(timeout=5)
            if self.data_parallel is not None:
                self.data_parallel.shutdown()
            if self.feed is not None:
                self.feed.join(timeout=5)
            server.join(timeout=5)
            final = self.final_stats()
            final.cpu_s, final.cpu_at_ready_s = node.cpu_seconds(), self.cpu_at_ready
            final.cpu_at_first_request_s = self.cpu_at_first_request
            final.peak_rss_mb = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
            stats = final.to_dict()
            node.write_stats(self.stats_path, stats)
            node.shutdown_dht(self.dht)
        if self.feed is not None and self.feed.failure is not None:
            raise RuntimeFailure(f"the replica could not read its samples: {self.feed.failure}",
                                 hint=f"check data.output ({self.run.data.output}): `agoractl shard FILE` makes it")
        return stats

    def final_stats(self) -> WorkerNodeStats:
        """The worker's statistics (its compute counters and where it ran; its data-parallel rounds)."""
        return WorkerNodeStats(
            **vars(self.worker.stats), peer=self.peer, stage=self.stage, pid=os.getpid(), phase=self.worker.phase,
            role=self.worker.role, step=self.worker.progress.step, started=self.started, announced=self.announced,
            dht_calls=self.dht_calls, throughput=self.worker.throughput,
            termination=self.termination.as_dict() if self.termination else None,
            resumed=self.resumed.facts() if self.resumed is not None else None,
            admission=admission.summary(self.admitted), progress_push=dict(self.progress_push.counts),
            feed=self.feed.summary() if self.feed is not None else None,
            **(self.data_parallel.summary() if self.data_parallel is not None else {}))

    def _fed_all(self) -> bool:
        """A self-fed replica trained what its feeder gave it and took its last step (or cannot: the data ran out)."""
        w = self.worker
        return (self.feed is not None and self.feed.ended.is_set() and not w.queued()
                and (w.progress.finished or not w.progress.should_step()))
