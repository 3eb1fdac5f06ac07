"""The data-parallel averaging transport over hivemind (report §3.3.1.7-8, §4.2): one flat tensor per
round, in the background, among the replicas of a stage.

This module only moves tensors: it is the
:class:`~agoractl.training.data_parallel.AveragingTransport` that both data-parallel methods run on
(SPARTA's segments, :mod:`agoractl.training.sparta_rounds`; FGDiLoCo's mixes,
:mod:`agoractl.training.fgdiloco_rounds`). :class:`StageAverager` is hivemind's
``DecentralizedAverager`` (a background process sharing the worker's DHT) over one shared buffer
sized for the largest tensor of a round: a round copies the values in (zero padding), runs
matchmaking and the butterfly all-reduce in the background, weighted as the method says (SPARTA:
the samples the worker processed since its last round), and hands back the average and which of
its values came back. :func:`stage_averager` builds one from the manifest section of the run's
method (``data_parallel.sparta`` or ``data_parallel.fgdiloco``: timeouts, chunk size, wire dtype).

- Roles (report §3.3.1.8): operators (``client_mode=False``) reduce a slice each and send;
  contributors (``client_mode=True``) only send and receive.
- Matchmaking: the round index is the group key (``<prefix>.0b<round mod 256>``), so replicas
  average the same segment; the group forms as soon as every expected peer of the stage joined, or
  at the end of the matchmaking window with whoever came (at least two).
- Fault tolerance is hivemind's: a sender silent past ``chunk_timeout_s`` is banned and the rest
  is averaged without it; a slice whose reducer fails keeps its local values. Such values, and
  values no sender with a positive weight contributed to (a group of weight-0 peers averages to
  0/0), are marked not averaged instead of being applied.
- Per round, a :class:`RoundRecord`: segment, group size, reduce success (reducers: the fraction
  of the values due from senders that arrived), averaging success (the fraction of this peer's
  values that came back averaged; report §5.7.1), duration and bytes on the wire.
- Fault injection (report §3.5.3.1): a round can be armed to preempt this worker during ``send``
  (after its first chunk went out) or ``reduce`` (a reducer, once it reduced its first chunk and
  before returning it): the worker's processes are killed abruptly and it exits with
  :data:`agoractl.algorithms.termination.EXIT_PREEMPTED`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import psutil
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import achain, anext, as_aiter, azip

from agoractl import logs
from agoractl.algorithms.termination import EXIT_PREEMPTED
from agoractl.algorithms.validation import update_mask
from agoractl.manifest.schema import Run
from agoractl.runtime.allreduce import StageAllReduce, wire_compression
from agoractl.runtime.faults import FAULT_POINTS
from agoractl.training.data_parallel import RoundRecord

_STATS = ("round", "finished", "group_size", "reducers", "senders", "weight", "group_weight",
          "reduce_expected", "reduce_received", "size", "averaged", "bytes_sent", "bytes_received",
          "matchmaking_s", "duration_s", "dropped_parts")
_S = {name: i for i, name in enumerate(_STATS)}


class StageAverager(DecentralizedAverager):
    """Background averaging of one flat tensor per round with the other replicas of a stage.

    `prefix` names the stage's averaging group in the DHT (run-, stage- and method-specific, no dots);
    `capacity` is the most values one round averages (SPARTA's largest segment). Host-side API:
    :meth:`begin_round`, then poll the returned :class:`PendingRound`. Operators also serve their
    stage state to joining workers through hivemind's ``load_state_from_peers`` once
    :attr:`state_provider` is set.
    """

    def __init__(self, dht, *, prefix: str, capacity: int, client_mode: bool, matchmaking_timeout_s: float,
                 allreduce_timeout_s: float, chunk_timeout_s: float, chunk_bytes: int = 2**19,
                 wire_dtype: str = "fp32", start: bool = True, startup_timeout_s: float = 120.0,
                 part_multiple: Optional[float] = None):
        if capacity < 1:
            raise ValueError(f"capacity must be positive; got {capacity}")
        self.capacity = capacity
        self.window_s = float(matchmaking_timeout_s)
        self.allreduce_timeout_s = float(allreduce_timeout_s)
        self.wire = wire_compression(wire_dtype)
        self.chunk_timeout_s = float(chunk_timeout_s)
        self.part_multiple = part_multiple
        """Bound on received parts and updates (validation.part_multiple); None checks finiteness only."""
        self._averaged = torch.zeros(capacity, dtype=torch.bool).share_memory_()
        self._stats = torch.zeros(len(_STATS), dtype=torch.float64).share_memory_()
        self._stats[_S["round"]] = -1
        self._plan: dict[str, Any] = {}
        self.state_provider: Optional[Callable[[], tuple[Any, Sequence[torch.Tensor]]]] = None
        min_time = min(5.0, self.window_s)
        super().__init__(
            [torch.zeros(capacity)], dht, start=False, prefix=prefix, target_group_size=None, min_group_size=2,
            min_matchmaking_time=min_time, request_timeout=min(3.0, min_time / 2),
            part_size_bytes=chunk_bytes, allreduce_timeout=allreduce_timeout_s,
            sender_timeout=self.chunk_timeout_s, reducer_timeout=2 * self.chunk_timeout_s,
            compression=self.wire, client_mode=client_mode, allow_state_sharing=not client_mode,
            declare_state_period=10.0, shutdown_timeout=5.0)
        _install_preemption_exit()
        if start:
            self.run_in_background(await_ready=True, timeout=startup_timeout_s)

    # ---- host side -------------------------------------------------------------------------------

    def begin_round(self, round_index: int, segment: int, values: torch.Tensor, weight: float,
                    expected_peers: int, fault: Optional[str] = None) -> "PendingRound":
        """Start averaging `values` (this replica's snapshot of `segment`) in the background.

        `weight`: samples processed since the last round (0 in the sync phases: absorb only);
        `expected_peers`: replicas of the stage believed alive, including this one (the group
        forms as soon as that many joined); `fault`: ``send`` / ``reduce`` to preempt this worker
        at that point of the round.
        """
        if fault is not None and fault not in FAULT_POINTS:
            raise ValueError(f"fault must be one of {FAULT_POINTS}; got {fault!r}")
        if weight < 0:
            raise ValueError(f"weight must be non-negative; got {weight}")
        n = int(values.numel())
        if n > self.capacity:
            raise ValueError(f"segment has {n} values; the averager holds {self.capacity}")
        with self.get_tensors() as (buf,):
            buf.zero_()
            buf[:n].copy_(values.reshape(-1).float())
        future = MPFuture()
        self._outer_pipe.send(("_prepare_round", [], dict(round_index=round_index, size=n, fault=fault,
                                                            group_size=max(2, int(expected_peers)), future=future)))
        future.result(timeout=60)
        started = time.monotonic()
        # A contributor never leads a group, and a leader turns down followers whose request expires
        # before its own window ends; replicas start a round at slightly different moments, so a
        # contributor's request stays open for two windows.
        window = self.window_s * (2 if self.client_mode else 1)
        control = self.step(gather=dict(round=round_index, weight=float(weight)), weight=float(weight),
                            scheduled_time=get_dht_time() + window,
                            timeout=window + 2 * self.request_timeout_s + 5.0, wait=False)
        return PendingRound(self, round_index, segment, n, float(weight), control, started,
                            snapshot_sum=float(values.double().sum()))

    @property
    def round_deadline_s(self) -> float:
        """The longest a round can last: matchmaking (two windows for a contributor) and the all-reduce."""
        return 2 * self.window_s + self.allreduce_timeout_s + 10.0

    @property
    def request_timeout_s(self) -> float:
        return float(self.matchmaking_kwargs["request_timeout"])

    def read_result(self, round_index: int, size: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """The buffer after a round: (values, which came back averaged, stats of that round)."""
        with self.get_tensors() as (buf,):
            values = buf[:size].clone()
        stats = {name: float(self._stats[i]) for i, name in enumerate(_STATS)}
        averaged = self._averaged[:size].clone()
        if int(stats["round"]) != round_index:
            stats = {}
        return values, averaged, stats

    def get_current_state(self):
        """Served to joining workers (hivemind's rpc_download_state), in the host process."""
        if self.state_provider is None:
            return dict(ready=False), [], None
        metadata, tensors = self.state_provider()
        return dict(metadata, ready=True), list(tensors), None

    def load_stage_state(self, timeout: float = 60.0) -> Optional[tuple[dict, list[torch.Tensor]]]:
        """Download the stage state from a live operator of the stage; None when none answered."""
        result = self.load_state_from_peers(wait=True, timeout=timeout)
        if result is None or not result[0] or not result[0].get("ready"):
            return None
        return result

    # ---- averager process ------------------------------------------------------------------------

    async def _prepare_round(self, round_index: int, size: int, group_size: int, fault: Optional[str],
                             future: MPFuture) -> None:
        # The group key carries the round, so only replicas averaging the same segment meet.
        mm = self._matchmaking
        mm.group_key_manager.group_bits = format(round_index % 256, "08b")
        mm.target_group_size = mm.potential_leaders.target_group_size = group_size
        # Replicas may count the stage differently (records propagate): a leader's group can be larger
        # than this peer's count, which hivemind's key rotation cannot take; the key is reset per round.
        mm.group_key_manager.target_group_size = None
        self._plan = dict(round=round_index, size=size, fault=fault, t0=time.monotonic())
        future.set_result(None)

    def _fault(self, point: str) -> None:
        """Preemption (report §3.5.3.1): the worker vanishes abruptly, its p2p daemon and DHT with it."""
        logs.get("agoractl.faults").warning("preempted", during=point, round=self._plan.get("round"))
        host, me = self._parent_pid, os.getpid()
        try:
            for proc in psutil.Process(host).children(recursive=True):
                if proc.pid != me:
                    proc.kill()
            os.kill(host, _PREEMPT_SIGNAL)
            psutil.Process(host).wait(timeout=5)
        except psutil.TimeoutExpired:
            os.kill(host, signal.SIGKILL)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
        os._exit(EXIT_PREEMPTED)

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's handler of a groupmate's parts, but waiting for this peer's runner through
        ``asyncio.shield``: a sender whose parts arrive before the runner exists and who then vanishes (a
        contributor preempted during send) gets its handler cancelled, and an unshielded wait would cancel
        the group's shared future with it - the runner could then not be registered ("invalid state") and
        the whole round failed for every peer instead of missing that sender's parts."""
        request = await anext(stream)
        if request.group_id not in self._running_groups:
            await self._pending_groups_registered.wait()  # the leader's reply may come after the first part
        future = self._running_groups.get(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        group = await asyncio.shield(future)
        async for message in group.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs) -> dict:
        """hivemind's, but holding the averaged tensors through :func:`held`. The all-reduce timeout cancels this
        coroutine; hivemind's ``enter_asynchronously(get_tensors())``, cancelled while its executor thread waits
        for the lock (the host copying a round in or out holds it), takes the lock after the cancel and never
        gives it back: the host's next ``get_tensors`` then blocked its compute thread for good (a worker with a
        1 ms all-reduce timeout stopped stepping instead of failing its rounds and leaving)."""
        try:
            bandwidths, mode_ids, gathered = zip(*map(self.serializer.loads, group_info.gathered))
            download = [b if AveragingMode(m) != AveragingMode.CLIENT else 0.0 for b, m in zip(bandwidths, mode_ids)]
            fractions = await asyncio.get_running_loop().run_in_executor(
                None, load_balance_peers, self.total_size, download, min_vector_size)
            async with held(self.lock_averaged_tensors):
                await self._run_allreduce_inplace_(self._averaged_tensors, group_info, peer_fractions=fractions,
                                                   **kwargs)
            return dict(zip(group_info.peer_ids, map(self.serializer.loads, gathered)))
        except BaseException as e:  # hivemind's contract: the step retries on a MatchmakingException
            if isinstance(e, Exception):
                logs.get("averaging").warning("all-reduce failed", error=f"{type(e).__name__}: {e}")
            raise MatchmakingException(f"Unable to run All-Reduce: {e}")

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: Optional[bytes] = None, **kwargs) -> None:
        plan = self._plan
        t_group = time.monotonic()
        group_id = group_info.group_id if group_id is None else group_id
        stats = self._stats
        stats.zero_()
        stats[_S["round"]] = -1
        runner = None
        try:
            runner = StageAllReduce(
                p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id,
                ordered_peer_ids=group_info.peer_ids, wire=self.wire, fault=plan.get("fault"),
                on_fault=self._fault, part_multiple=self.part_multiple, **kwargs)
            assert group_id in self._running_groups, f"group {group_id} was not registered"
            self._running_groups[group_id].set_result(runner)
            async for tensor, update in azip(as_aiter(*tensors), runner):
                came_back = (torch.isfinite(update) if self.part_multiple is None
                             else update_mask(update, tensor, self.part_multiple))
                tensor.add_(torch.where(came_back, update, torch.zeros_like(update)).to(tensor.dtype))
                self._averaged.copy_(came_back.reshape(-1))
            await runner.wait_served(2 * self.chunk_timeout_s)
            for start, stop in runner.unmixed_ranges():
                self._averaged[start:stop] = False
            stats[_S["finished"]] = 1
        finally:
            size = int(plan.get("size", self.capacity))
            gathered = [self.serializer.loads(self.serializer.loads(g)[2]) or {} for g in group_info.gathered]
            modes = [AveragingMode(self.serializer.loads(g)[1]) for g in group_info.gathered]
            stats[_S["group_size"]] = len(group_info.peer_ids)
            stats[_S["reducers"]] = sum(m == AveragingMode.NODE for m in modes)
            stats[_S["senders"]] = sum(m != AveragingMode.AUX for m in modes)
            stats[_S["weight"]] = float(kwargs.get("weight") or 0.0)
            stats[_S["group_weight"]] = sum(float(g.get("weight", 0.0)) for g in gathered)
            stats[_S["size"]] = size
            stats[_S["averaged"]] = int(self._averaged[:size].sum()) if stats[_S["finished"]] else 0
            if runner is not None:
                stats[_S["reduce_expected"]], stats[_S["reduce_received"]] = runner.reduce_counts()
                stats[_S["bytes_sent"]], stats[_S["bytes_received"]] = runner.bytes_sent, runner.bytes_received
                stats[_S["dropped_parts"]] = runner.dropped_parts
            t0 = plan.get("t0", t_group)
            stats[_S["matchmaking_s"]] = t_group - t0
            stats[_S["duration_s"]] = time.monotonic() - t0
            stats[_S["round"]] = plan.get("round", -1)


@contextlib.asynccontextmanager
async def held(lock) -> AsyncIterator[None]:
    """`lock` (a threading or multiprocessing lock) held from an event loop without blocking it: the wait runs in
    an executor thread, and if the waiting coroutine is cancelled meanwhile, the lock is released as soon as that
    thread gets it, rather than left taken by nobody."""
    acquiring = asyncio.get_running_loop().run_in_executor(None, lock.acquire)
    try:
        await asyncio.shield(acquiring)
    except BaseException:
        acquiring.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or lock.release())
        raise
    try:
        yield
    finally:
        lock.release()


def averager_prefix(run: str, stage: str, method: str) -> str:
    """The stage's averaging group in the DHT (hivemind prefixes may not contain dots)."""
    return f"{run}_{stage}_{method}".replace(".", "_")


def stage_averager(run: Run, stage: str, role: str, dht, capacity: int, cls=None, **extra) -> StageAverager:
    """The averaging transport of a worker of `stage` (`role`: operator or contributor), set from the
    manifest section of the run's data-parallel method; started, sharing the worker's `dht`. `cls` and
    `extra`: a subclass and its own arguments (admission on: :mod:`agoractl.runtime.averaging_auth`)."""
    method = run.data_parallel.method
    if method not in ("sparta", "fgdiloco"):
        raise ValueError(f"data_parallel.method {method!r} averages nothing; expected sparta or fgdiloco")
    cfg, v = getattr(run.data_parallel, method), run.validation
    # SPARTA averages parameters (alike across replicas: bounded); FGDiLoCo's deltas may differ widely (finite only).
    bound = None if not v.enabled else v.part_multiple if method == "sparta" else math.inf
    return (cls or StageAverager)(
        dht, prefix=averager_prefix(run.metadata.name, stage, method), capacity=capacity,
        client_mode=role == "contributor", matchmaking_timeout_s=cfg.matchmaking_timeout_s,
        allreduce_timeout_s=cfg.allreduce_timeout_s, chunk_timeout_s=cfg.chunk_timeout_s,
        chunk_bytes=cfg.chunk_bytes, wire_dtype=cfg.wire_dtype, startup_timeout_s=run.network.startup_timeout_s,
        part_multiple=bound, **extra)


class PendingRound:
    """A round running in the background (a :class:`~agoractl.training.data_parallel.PendingAverage`);
    poll :meth:`done`, then take :meth:`result` once."""

    def __init__(self, averager: StageAverager, round_index: int, segment: int, size: int, weight: float,
                 control: StepControl, started: float, snapshot_sum: Optional[float] = None):
        self.averager, self.round, self.segment, self.size = averager, round_index, segment, size
        self.weight, self.control, self.started = weight, control, started
        self.snapshot_sum = snapshot_sum

    def done(self) -> bool:
        return self.control.done()

    def cancel(self) -> None:
        self.control.cancel()

    def looking(self) -> bool:
        """Still in matchmaking (no all-reduce begun, nothing sent): :meth:`cancel` ends it at once, and the
        averager is free for another round."""
        return not self.control.done() and not self.control.began_allreduce and self.control.stage in (
            AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP, AveragingStage.AWAITING_TRIGGER)

    def result(self, timeout: Optional[float] = None) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], RoundRecord]:
        """(average, averaged mask, record). The average is None when nothing came back; values
        whose mask is False did not come back and must keep their local values."""
        error = None
        try:
            self.control.result(timeout=timeout)
        except Exception as e:  # no group in the window, all-reduce timeout, a broken stream
            error = f"{type(e).__name__}: {e}".strip().rstrip(":")[:300]
        values, averaged, stats = self.averager.read_result(self.round, self.size)
        rec = RoundRecord(round=self.round, segment=self.segment, status="failed", weight=self.weight,
                          duration_s=round(time.monotonic() - self.started, 3), error=error,
                          snapshot_sum=self.snapshot_sum, grouped=bool(self.control.began_allreduce))
        if stats:
            rec.group_size, rec.reducers = int(stats["group_size"]), int(stats["reducers"])
            rec.group_weight = stats["group_weight"]
            rec.bytes_sent, rec.bytes_received = int(stats["bytes_sent"]), int(stats["bytes_received"])
            rec.dropped_parts = int(stats["dropped_parts"])
            rec.matchmaking_s = round(stats["matchmaking_s"], 3)
            rec.duration_s = round(stats["duration_s"], 3)
            if stats["reduce_expected"] > 0:
                rec.reduce_success = stats["reduce_received"] / stats["reduce_expected"]
        if error is not None or not stats or not stats["finished"]:
            rec.error = rec.error or "all-reduce did not finish"
            return None, None, rec
        if rec.group_weight <= 0:
            rec.status = "empty"
            return None, None, rec
        rec.averaging_success = stats["averaged"] / max(1.0, stats["size"])
        rec.status = "complete" if rec.averaging_success >= 1.0 else ("partial" if rec.averaging_success > 0 else "failed")
        if rec.status == "failed":
            rec.error = "no averaged slice came back"
            return None, None, rec
        rec.average_sum = float(values[averaged].double().sum())
        return values, averaged, rec


# ---- preemption exit in the worker (host) process ---------------------------------------------------

_PREEMPT_SIGNAL = signal.SIGUSR1


def _install_preemption_exit() -> None:
    """The averager process signals the worker process to exit at once when a preemption strikes."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may install handlers; the averager then falls back to SIGKILL
    signal.signal(_PREEMPT_SIGNAL, lambda *_: os._exit(EXIT_PREEMPTED))
