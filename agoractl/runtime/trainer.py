"""A trainer (``agoractl launch trainer``, report §3.3.2): holds no parameters, walks samples through the pipeline.

For each sample it sends the forward head → body → tail, to the worker each stage's
:class:`~agoractl.algorithms.balancer.Balancer` chooses (where replicas step on their own counts, the replica
:class:`~agoractl.algorithms.routing.ReplicaRoute` assigns the sample: ``agoractl simulate``'s split; routing is
applied in :mod:`agoractl.runtime.trainer_routing`), keeping every stage's input wire tensor; the tail's
fused call computes forward, loss and backward at once (a run of one ``whole`` stage makes only that call, no
wire); then the backward unwinds tail → head, each stage's **pinned** to the worker that ran its forward (report
§4.2.1). Only when that worker is gone (the call fails) does the backward fall back to another replica, which
recomputes the forward under its own weights; fallbacks are counted. A failed forward is re-sent to another
replica (up to ``trainers.retries`` times); a failed worker is banned for ``trainers.ban_s``. A sample that runs
out of retries, or finds no replica, is counted as lost — every dispatched sample ends completed or lost.
``trainers.in_flight`` requests travel at once (concurrent pipelines), each of ``trainers.microbatch`` samples
(1 by default, as in the report: workers coalesce).

Tensors on the wire are what the workers send: SSN coordinates (k per token) when ``model.ssn`` is set, never
a d-wide tensor; token ids travel as int32. Discovery reads each stage's worker records every
``trainers.discovery_period_s`` (workers in weight sync are skipped). The trainer publishes loss, samples and
tokens consumed per shard in the DHT, and stops once every stage has taken ``training.max_steps`` steps
(``training.until_step`` when set; seen in the workers' replies and records) or its data runs out; where replicas
step on their own counts (``data_parallel.fgdiloco.replicas``), once every live replica of every stage has
(:class:`~agoractl.algorithms.progress.ReplicaSteps`; one that finished early answers "finished", and one
waiting in a blocking mix "waiting", untrained: the sample goes to another replica, or a pinned backward
waits). When no sample completes for ``trainers.stall_timeout_s`` (a stage without a reachable worker, an
unreachable DHT), it logs why, stops and :meth:`Trainer.train` raises :class:`~agoractl.errors.StalledRun` (exit 3).

Every reply is checked before it is used (:class:`~agoractl.algorithms.validation.ReplyChecks`, with
``validation.enabled``): a non-finite, malformed or absurd output, gradient or loss is **rejected**, counted in
``faults`` per worker, and the request goes to another replica; the worker is banned for ``fault_ban_s``
(doubling on repeats) and told so (a ``notice``) — unless it is its stage's last serving worker and the
fault a magnitude bound alone (:meth:`~agoractl.algorithms.validation.FaultBook.record` says why).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import secrets
import signal
import threading
import time
from typing import Iterator, Optional, Sequence

import torch

from agoractl import logs
from agoractl.auth import node_key
from agoractl.errors import StalledRun
from agoractl.manifest.schema import Run
from agoractl.runtime import admission, node
from agoractl.algorithms.balancer import Balancer
from agoractl.algorithms.progress import ReplicaSteps
from agoractl.runtime.metrics import NodeMetrics, trainer_sample
from agoractl.runtime.records import SERVING_PHASES, RunRecords, TrainerRecord
from agoractl.runtime.swarm_supervisor import StallClock
from agoractl.runtime.trainer_data import TrainerData
from agoractl.runtime.trainer_routing import WAITING_S, TrainerRouting
from agoractl.runtime.transport import StageClient
from agoractl.algorithms.routing import ReplicaRoute
from agoractl.algorithms.validation import FaultBook, ReplyChecks
from agoractl.training.data_resume import DrawLog
from agoractl.training.node_stats import FINISHED_REASONS, TrainerNodeStats, TrainerStageStats

class ReplicaFinished(Exception):
    """A replica stepping on its own count answered that it took its last step (the sample is not trained)."""


class ReplicaWaiting(Exception):
    """A replica stepping on its own count answered that it waits in a blocking mix (the sample is not trained)."""


PUBLISH_S = 2.0  # seconds between the trainer's DHT records (the swarm's live progress)
DATA_REPORT_S = 10.0  # seconds between reports of data consumption to the shard ledger's progress files


class Trainer(TrainerData, TrainerRouting):
    """One trainer process: DHT client, per-stage balancers, concurrent sample pipelines."""

    def __init__(self, run: Run, index: int, initial_peers: Sequence[str], stats_path: Optional[str] = None,
                 samples: Optional[Iterator[torch.Tensor]] = None, min_workers: int = 1,
                 positions=None, resume_step: int = 0):
        self.run, self.index, self.stats_path = run, index, stats_path
        self.min_workers = max(1, int(min_workers))
        self.stages = run.stage_names()
        self.t = run.trainers
        self.log, self.stop = logs.get("trainer"), threading.Event()
        self._stream = samples
        self.positions = positions
        """Data positions by checkpoint step (:class:`agoractl.training.data_resume.CheckpointPositions`)."""
        self.draws = DrawLog() if positions is not None else None
        self.resume_step, self.resumed = resume_step, {"step": resume_step, "source": "ledger"}
        self.dht = node.start_dht(run, node.require_peers(initial_peers, "trainer"), client_mode=True)
        self.peer = self.dht.peer_id.to_base58()
        self.admitted = admission.enter(run, self.dht, "trainer")  # None when admission is off
        self.records = RunRecords(self.dht, run.metadata.name)
        self.balancers = {s: Balancer(self.t.ban_s) for s in self.stages}
        self.checks = ReplyChecks(run) if run.validation.enabled else None
        self.faults = FaultBook(run.validation.fault_ban_s)
        self._notices: set[asyncio.Task] = set()
        self.counters = {s: TrainerStageStats() for s in self.stages}
        self.stats = TrainerNodeStats(trainer=index, stages=self.counters)
        self.seen_step = {s: 0 for s in self.stages}
        grace = 3 * run.workers.announce_period_s + self.t.discovery_period_s  # a worker record's TTL, and a read
        self.replica_steps = {s: ReplicaSteps(run.training.stop_step, grace) for s in self.stages} \
            if run.replica_batch else None  # replicas stepping on their own counts: each one's step
        fg = run.data_parallel.fgdiloco  # ... and the deterministic split of the samples among them
        self.routes = {s: ReplicaRoute(run.replica_batch, fg.matchmaking_timeout_s + fg.allreduce_timeout_s)
                       for s in self.stages} if run.replica_batch else None
        self.samples_drawn = 0
        self._held: dict[str, dict[str, float]] = {s: {} for s in self.stages}
        """Per stage, replicas that answered "waiting" (in a blocking mix) and until when they are skipped."""
        self._unfinished: collections.Counter = collections.Counter()  # block -> samples drawn, not yet finished
        self._blocks_changed = asyncio.Condition()  # (TrainerRouting._await_turn)
        self.seen_workers: dict[str, set[str]] = {s: set() for s in self.stages}
        self.in_flight, self.cpu_at_start = 0, {}
        self._recent_loss: list[float] = []
        self.key = node_key.load_or_create()
        self.last_loss: Optional[float] = None
        self.metrics = NodeMetrics(run, "trainer", "", node_key.instance_id(self.key), trainer_sample(self))
        self.stats.session, self.seq = secrets.token_hex(8), 0
        self._dht_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer-dht")
        self._data_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer-data")
        self._ahead: Optional[list] = None  # the first draws, made while waiting for workers (_draw_ahead)
        self._last_discovery = {s: float("-inf") for s in self.stages}
        self.stall = StallClock(self.t.stall_timeout_s, time.monotonic())
        self.stall.observe(0, time.monotonic())
        self.stalled: Optional[str] = None
        self._dht_error: Optional[str] = None
        logs.bind(run=run.metadata.name, role="trainer", trainer=index, peer=self.peer[-8:])

    # -- helpers ------------------------------------------------------------------------------

    async def _dht(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._dht_pool, fn, *args)

    def finished(self) -> bool:
        if self.replica_steps is not None:
            now = time.monotonic()
            return all(self.replica_steps[s].finished(self.balancers[s].workers, now) for s in self.stages)
        return all(self.seen_step[s] >= self.run.training.stop_step for s in self.stages)

    async def discover(self, stage: str) -> None:
        """Refresh one stage's membership from the DHT (workers in weight sync are invisible)."""
        self._last_discovery[stage] = time.monotonic()
        try:
            found = await self._dht(self.records.stage_workers, stage)
        except Exception as e:
            self._dht_error = f"{type(e).__name__}: {e}"[:200]
            self.log.warning("discovery failed", stage=stage, error=self._dht_error)
            return
        self._dht_error = None
        if not found:  # a read that missed (every live worker has a record): a stage is not dropped on it
            return
        serving = {p: (r.throughput or None) for p, r in found.items() if r.phase in SERVING_PHASES}
        added, removed = self.balancers[stage].update(serving, time.monotonic())
        self.seen_workers[stage].update(serving)
        self.seen_step[stage] = max(self.seen_step[stage], max(r.step for r in found.values()))
        for p, r in found.items() if self.replica_steps is not None else ():
            self.replica_steps[stage].saw(p, r.step, time.monotonic())
        if added or removed:
            self.log.info("workers changed", stage=stage, added=len(added), removed=len(removed), live=len(serving))

    async def _discovery_loop(self) -> None:
        while not self.stop.is_set():
            await asyncio.gather(*(self.discover(s) for s in self.stages))
            await asyncio.sleep(self.t.discovery_period_s)

    async def _call(self, stage: str, peer: str, method: str, tensors: dict) -> tuple[dict, dict]:
        t0 = time.monotonic()
        out, meta = await self.client.call(peer, stage, method, tensors, {"trainer": self.index},
                                           timeout=self.t.request_timeout_s)
        if self.replica_steps is not None and "step" in meta:
            self.replica_steps[stage].saw(peer, meta["step"], time.monotonic())
            if meta.get("finished") or meta.get("waiting"):  # answered at once, untrained: it owes nothing
                self.balancers[stage].refund(peer, float(tensors["ids"].shape[0]))
                if meta.get("finished"):
                    raise ReplicaFinished(peer)
                self._held[stage][peer] = time.monotonic() + WAITING_S
                if self.routes is not None:
                    self.routes[stage].waiting(peer, time.monotonic())
                raise ReplicaWaiting(peer)
            if self.routes is not None:
                self.routes[stage].served(peer)
        if self.checks is not None:
            t1 = time.thread_time()  # the checks' own CPU time: what validation costs (stats.checks_s)
            try:
                self.checks.check(stage, method, tensors, out, meta)  # Invalid: the caller bans and re-routes
            finally:
                self.stats.checks_s += time.thread_time() - t1
        self.balancers[stage].record_success(peer, float(tensors["ids"].shape[0]), time.monotonic() - t0)
        if "step" in meta:
            self.seen_step[stage] = max(self.seen_step[stage], int(meta["step"]))
        return out, meta

    async def _dispatch(self, stage: str, method: str, tensors: dict, exclude: Sequence[str] = (),
                        sample: Optional[int] = None):
        """(peer, outputs, meta) from the first replica that serves the request; None when the retries
        run out or no replica is available. Every re-send after a failure counts as a retry. `sample`: the
        trainer's index of the request's first sample (routes replicas stepping on their own counts)."""
        try:
            return await self._dispatch_to(stage, method, tensors, set(exclude), sample)
        finally:
            if self.routes is not None and sample is not None:
                self.routes[stage].forget(sample, int(tensors["ids"].shape[0]))

    async def _dispatch_to(self, stage: str, method: str, tensors: dict, tried: set, sample: Optional[int]):
        attempt, exclude = 0, set(tried)
        while attempt <= self.t.retries:
            peer = await self._choose(stage, tried, float(tensors["ids"].shape[0]), sample)
            if peer is None:
                return None
            if attempt > 0 or exclude:
                self.counters[stage].retries += 1
            try:
                out, meta = await self._call(stage, peer, method, tensors)
                return peer, out, meta
            except ReplicaWaiting:  # in a blocking mix: another replica, or this one once it is out (no retry used)
                continue
            except ReplicaFinished:  # it took its last step: another replica trains the sample
                tried.add(peer)
            except Exception as e:  # error reply, timeout, or the worker is gone
                self._fail(stage, peer, method, e)
                tried.add(peer)
            attempt += 1
        return None

    async def _backward(self, stage: str, pinned: str, tensors: dict):
        """The backward on the worker that ran the forward; another replica only if that one fails."""
        deadline = time.monotonic() + self.t.request_timeout_s
        try:
            while True:
                try:
                    out, meta = await self._call(stage, pinned, "backward", tensors)
                    return pinned, out, meta
                except ReplicaWaiting:  # pinned: it computes this backward once out of its mix
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(WAITING_S)
        except ReplicaFinished:  # the forward's replica took its last step meanwhile: nobody applies this one
            return None
        except Exception as e:
            self._fail(stage, pinned, "backward", e)
        result = await self._dispatch(stage, "backward", tensors, exclude=[pinned])
        if result is not None:
            self.counters[stage].backward_fallbacks += 1
        return result

    # -- one sample ---------------------------------------------------------------------------

    def _lose(self, stage: str, direction: str, n: int) -> bool:
        if self.replica_steps is not None and self.finished():
            return False  # every replica took its last step meanwhile: a surplus sample, not a lost one
        self.stats.lost += n
        key = f"{stage}/{direction}"
        self.stats.lost_at[key] = self.stats.lost_at.get(key, 0) + n
        self.log.warning("samples lost", stage=stage, direction=direction, samples=n)
        return False

    async def run_sample(self, samples: torch.Tensor, seq_ids: Optional[list] = None,
                         draw: Optional[int] = None, sample: Optional[int] = None) -> bool:
        """Forward through every stage, the tail's fused loss and backward, then the pinned backward.

        `samples`: one sample [seq_len+1] or a microbatch [m, seq_len+1] (trainers.microbatch); `sample`: the
        trainer's index of its first sample (:class:`~agoractl.algorithms.routing.ReplicaRoute`)."""
        ids = samples.to(torch.int32).reshape(-1, samples.shape[-1])
        n, path, inputs, wire = ids.shape[0], [], [], None  # forward peers, the wire each got, the wire now
        for stage in self.stages[:-1]:
            sent = {"ids": ids, **({"wire": wire} if wire is not None else {})}
            result = await self._dispatch(stage, "forward", sent, sample=sample)
            if result is None:
                return self._lose(stage, "forward", n)
            peer, out, _ = result
            path.append(peer)
            inputs.append(wire)
            wire = out["wire"]
        tail, sent = self.stages[-1], {"ids": ids, **({} if wire is None else {"wire": wire})}  # whole: no wire
        result = await self._dispatch(tail, "forward_backward", sent, sample=sample)
        if result is None:
            return self._lose(tail, "forward_backward", n)
        _, out, meta = result
        losses, grad = out["loss"].reshape(-1).tolist(), out.get("grad")  # no grad from a whole-model stage
        step = int(meta.get("step", 0))
        if draw is not None:
            self.draws.counted(draw, step)
        entry = self.stats.loss.setdefault(step, [0.0, 0])
        entry[0], entry[1] = entry[0] + sum(losses), entry[1] + len(losses)
        self._recent_loss.extend(losses)
        self.stats.loss_sum += sum(losses)
        self.stats.loss_samples += len(losses)
        for i in reversed(range(len(self.stages) - 1)):
            stage = self.stages[i]
            tensors = {"ids": ids, "grad": grad, **({"wire": inputs[i]} if inputs[i] is not None else {})}
            result = await self._backward(stage, path[i], tensors)
            if result is None:
                return self._lose(stage, "backward", n)
            grad = result[1].get("grad")
        if seq_ids and self.t.record_sequences:
            self.stats.sequences.extend([*i, step] for i in seq_ids)
        return True

    # -- the loop -----------------------------------------------------------------------------

    async def _pipeline(self) -> None:
        while not self.stop.is_set() and not self.finished():
            await self._mark_checkpoint()
            drawn = await self._next_draw()
            if drawn is None:
                if not (self.stop.is_set() or self.finished()):
                    epochs = getattr(getattr(self._stream, "claims", None), "epochs_done", None)
                    self.stats.finished_reason = self.stats.finished_reason or (
                        f"data exhausted after {epochs} epoch(s)" if epochs else "data exhausted")
                return
            batch, seq_ids, draw, sample = drawn
            n = batch.shape[0]
            self._open_blocks(sample, n)
            await self._await_turn(sample, n)  # replicas on their own counts in a pipeline: each one's blocks in order
            if self.finished() or self.stop.is_set():
                await self._close_blocks(sample, n)
                return  # drawn but never dispatched: not lost samples
            self.stats.dispatched += n
            self.stats.first_dispatch = self.stats.first_dispatch or time.time()
            self.in_flight += n
            ok = False
            try:
                if ok := await self.run_sample(batch, seq_ids, draw, sample):
                    self.stats.completed += n
                    self.stats.last_completion = time.time()
                    self.stall.observe(self.stats.completed, time.monotonic())
            finally:
                self.in_flight -= n
                await self._close_blocks(sample, n)
                if seq_ids and hasattr(self._stream, "settle"):
                    self._settle(seq_ids, ok)
                    await asyncio.get_running_loop().run_in_executor(self._data_pool, self._stream.flush)

    def record(self, done: bool = False) -> TrainerRecord:
        recent, self._recent_loss = self._recent_loss, []
        self.last_loss = sum(recent) / len(recent) if recent else self.last_loss
        tail_step = max(self.stats.loss, default=0)
        tokens = getattr(self._stream, "tokens_consumed", lambda: {})()
        self.seq += 1
        return TrainerRecord(trainer=self.index, peer=self.peer, dispatched=self.stats.dispatched,
                             completed=self.stats.completed, lost=self.stats.lost, in_flight=self.in_flight,
                             loss=sum(recent) / len(recent) if recent else None, tail_step=tail_step,
                             tokens=tokens, pid=os.getpid(), done=done, faults=self.faults.counts,
                             session=self.stats.session, seq=self.seq, loss_sum=self.stats.loss_sum,
                             loss_samples=self.stats.loss_samples)

    async def _publish_loop(self) -> None:
        last_data_report = time.monotonic()
        while not self.stop.is_set():
            await asyncio.sleep(PUBLISH_S)
            try:
                await self._dht(self.records.publish_trainer, self.record(), 10 * PUBLISH_S + self.t.discovery_period_s,
                                self.key)
            except Exception as e:
                self.log.warning("publishing progress failed", error=f"{type(e).__name__}: {e}")
            if time.monotonic() - last_data_report > min(DATA_REPORT_S, self.run.data.lease_s / 3):
                last_data_report = time.monotonic()
                await self._report_data()

    async def _wait_for_stages(self) -> None:
        """Training begins when every stage advertises an available worker (§3.3.2.1), or `min_workers` of them."""
        t0 = time.monotonic()
        self._draw_ahead()
        while not self.stop.is_set():
            if hasattr(self._stream, "flush"):  # keep the shards claimed at start leased meanwhile
                await asyncio.get_running_loop().run_in_executor(self._data_pool, self._stream.flush)
            await asyncio.gather(*(self.discover(s) for s in self.stages))
            missing = [s for s in self.stages
                       if len(self.balancers[s].available(time.monotonic())) < self.min_workers]
            if not missing:
                return
            if time.monotonic() - t0 > 10:
                self.log.info("waiting for workers", stages=missing)
                t0 = time.monotonic()
            await asyncio.sleep(0.5)

    def stall_cause(self) -> str:
        """Why no sample completes: the stages without a reachable worker, or the DHT."""
        if self._dht_error:
            return f"the DHT is unreachable ({self._dht_error})"
        now = time.monotonic()
        cut = [s for s in self.stages if not self.balancers[s].available(now)]
        if cut:
            return "; ".join(f"stage {s} has no reachable worker ({len(self.seen_workers[s])} seen, all gone or banned)"
                             for s in cut)
        lost = ", ".join(f"{k}: {v}" for k, v in self.stats.lost_at.items())
        return "every stage has a worker, yet no sample completes" + (f" (lost at {lost})" if lost else "")

    async def _stall_loop(self) -> None:
        """trainers.stall_timeout_s without a completed sample: say why and stop (train() then raises)."""
        while self.t.stall_timeout_s > 0 and not self.stop.is_set():
            await asyncio.sleep(1.0)
            if self.stall.stalled(time.monotonic()):
                self.stalled = f"no sample completed for {self.stall.idle_s(time.monotonic()):.0f} s: " \
                               f"{self.stall_cause()}"
                self.log.error("stalled", reason=self.stalled)
                self.stats.finished_reason = f"stalled: {self.stalled}"
                self.stop.set()

    async def _main(self) -> None:
        self.client = StageClient(await self.dht.replicate_p2p(), self.run.metadata.name,
                                  self.admitted.current if self.admitted is not None else None)
        watchdog = asyncio.create_task(self._stall_loop())
        try:
            await self._train()
        finally:
            watchdog.cancel()

    async def _train(self) -> None:
        await self._wait_for_stages()
        self.cpu_at_start = node.cpu_seconds()
        self.log.info("trainer starts", in_flight=self.t.in_flight, microbatch=self.t.microbatch)
        background = [asyncio.create_task(self._discovery_loop()), asyncio.create_task(self._publish_loop())]
        try:
            await asyncio.gather(*(self._pipeline() for _ in range(self.t.in_flight)))
        finally:
            for task in background:
                task.cancel()
        await self._mark_checkpoint()  # the last step's position (the stages finished)
        if self.finished():
            self.stats.finished_reason = FINISHED_REASONS[self.run.training.until_step is not None]
        elif self.stop.is_set():
            sig = getattr(self.stop, "signum", None)
            self.stats.finished_reason = self.stats.finished_reason or (
                f"interrupted by {signal.Signals(sig).name}" if sig else "stopped")

    def train(self) -> dict:
        """Run until every stage reached max_steps, the data ran out, or a stop signal; returns the stats."""
        node.stop_on_signals(self.stop)
        node.watch_parent(self.stop)
        try:
            self._open_stream()
            url = self.metrics.start(self.admitted.current if self.admitted is not None else lambda: None)
            if url:
                self.log.info("metrics served", url=url, instance=self.metrics.labels["instance"])
            asyncio.run(self._main())
        finally:
            self.metrics.stop()
            final = self.final_stats()
            final.cpu_s, final.cpu_at_start_s = node.cpu_seconds(), self.cpu_at_start
            stats = final.to_dict()
            try:
                self.records.publish_trainer(self.record(done=True), 60.0, self.key)
            except Exception:
                pass
            if hasattr(self._stream, "position"):
                try:
                    from agoractl.data.stream import report_progress

                    report_progress(self.run, self.index, self._stream)
                except Exception:
                    pass
            node.write_stats(self.stats_path, stats)
            self._dht_pool.shutdown(wait=False)
            self._data_pool.shutdown(wait=False)
            node.shutdown_dht(self.dht)
        self.log.info("trainer done", reason=stats["finished_reason"], completed=stats["completed"], lost=stats["lost"])
        if self.stalled:
            raise StalledRun(f"trainer {self.index} stalled: {self.stalled}",
                             hint="start workers for that stage (agoractl launch worker FILE --stage ...), or "
                                  "raise trainers.stall_timeout_s")
        return stats

    def final_stats(self) -> TrainerNodeStats:
        """The trainer's statistics, with what only its end knows filled in."""
        for s in self.stages:
            self.counters[s].bans = self.balancers[s].bans
            self.counters[s].workers_seen = sorted(self.seen_workers[s])
        self.stats.peer, self.stats.pid, self.stats.resumed = self.peer, os.getpid(), self.resumed
        self.stats.faults, self.stats.seen_step = dict(self.faults.counts), dict(self.seen_step)
        self.stats.admission, self.stats.checks_s = admission.summary(self.admitted), round(self.stats.checks_s, 4)
        self.stats.tokens = dict(getattr(self._stream, "tokens_consumed", lambda: {})())
        return self.stats
