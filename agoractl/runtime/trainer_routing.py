"""A trainer's routing (:class:`~agoractl.runtime.trainer.Trainer` inherits it): which worker of a stage a request
goes to, and what a failed call does to that worker.

The decisions are pure and live in :mod:`agoractl.algorithms`: the stage's
:class:`~agoractl.algorithms.balancer.Balancer` (least virtual runtime) by default, and where replicas step on
their own counts (``data_parallel.fgdiloco.replicas``), the deterministic split of
:class:`~agoractl.algorithms.routing.ReplicaRoute` first, the balancer only for its fallbacks. This module only
applies them: it waits for discovery, skips replicas held in a blocking mix or finished, bans failed workers, and
lifts the earliest-ending ban when a stage has had no available worker for ``trainers.request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from agoractl.algorithms.validation import Invalid

WAITING_S = 0.1
"""Seconds a replica that answered "waiting" is skipped before it is asked again."""


class TrainerRouting:
    """The routing methods of a trainer; the attributes they use (run, stages, t, balancers, routes, replica_steps,
    _held, _unfinished, _blocks_changed, counters, faults, log, client, stop, _notices, _last_discovery, discover)
    are the Trainer's."""

    # -- block order: pipelines of replicas on their own counts ---------------------------------------------
    # With replicas on their own counts in a pipeline, block n of the trainer's samples must not reach a stage
    # before block n - M (the same replica's previous block, M = data_parallel.fgdiloco.replicas) finished: that
    # block's backward may complete the replica's step, and a forward of the next step's samples computed
    # before it would run on the weights of the step before (a stale wire, unlike the simulator's replicas).
    # A whole model has no such gap (one fused call per sample), so its blocks run in any order.

    def _ordered_blocks(self) -> Optional[int]:
        """M when blocks are ordered (see above), else None."""
        return self.run.data_parallel.fgdiloco.replicas if self.routes is not None and len(self.stages) > 1 else None

    def _blocks_of(self, sample: int, n: int) -> list[int]:
        return sorted({i // self.run.replica_batch for i in range(sample, sample + n)})

    def _open_blocks(self, sample: Optional[int], n: int) -> None:
        """Register a drawn microbatch's blocks (draws run in order: an earlier block is registered already)."""
        if self._ordered_blocks() is None or sample is None:
            return
        for i in range(sample, sample + n):
            self._unfinished[i // self.run.replica_batch] += 1

    async def _await_turn(self, sample: Optional[int], n: int) -> None:
        """Wait until the previous block of the same replica finished (every sample completed or lost)."""
        m = self._ordered_blocks()
        if m is None or sample is None:
            return
        async with self._blocks_changed:
            await self._blocks_changed.wait_for(
                lambda: self.stop.is_set() or all(self._unfinished[b - m] == 0 for b in self._blocks_of(sample, n)))

    async def _close_blocks(self, sample: Optional[int], n: int) -> None:
        if self._ordered_blocks() is None or sample is None:
            return
        for i in range(sample, sample + n):
            b = i // self.run.replica_batch
            self._unfinished[b] -= 1
            if self._unfinished[b] <= 0:
                del self._unfinished[b]  # a long run does not keep one entry per block
        async with self._blocks_changed:
            self._blocks_changed.notify_all()

    async def _choose(self, stage: str, exclude: set[str], task_size: float = 1.0,
                      sample: Optional[int] = None) -> Optional[str]:
        """A worker for `stage`, waiting for discovery (up to request_timeout_s) when none is available.

        `sample`: the trainer's index of the request's first sample, when its replica is routed by
        :class:`~agoractl.algorithms.routing.ReplicaRoute`."""
        deadline = time.monotonic() + self.t.request_timeout_s
        route = self.routes[stage] if self.routes is not None and sample is not None else None
        balancer = self.balancers[stage]
        while True:
            now = time.monotonic()
            unavailable, wait, peer = set(exclude) | self._unavailable(stage, now), False, None
            if route is not None:
                held = set(self._held[stage])
                banned = {p for p in balancer.workers if balancer.is_banned(p, now)}
                decision = route.decide(sample, balancer.workers, (unavailable - held) | banned, held, now,
                                        int(task_size))
                if decision.peer is not None:
                    return balancer.charge(decision.peer, task_size)
                wait = decision.wait
            if wait:  # the route's waits end by themselves (a mix, an earlier request): no sample is lost for them
                deadline = now + self.t.request_timeout_s
            else:
                peer = balancer.choose(now, task_size, unavailable)
                if route is not None and peer is not None and \
                        route.assigned(sample, balancer.workers) not in self.replica_steps[stage].done():
                    self.counters[stage].route_fallbacks += 1  # not the surplus of a replica past its last step
            if peer is None and route is None and not self.stop.is_set() and time.monotonic() > deadline:
                # No worker of the stage came free in time: rather than lose the sample, try again the banned
                # worker whose ban ends first (a ban routes around a worker; it must not stop the stage).
                peer = balancer.pardon(time.monotonic(), unavailable)
                if peer is not None:
                    self.log.warning("no available worker; ban lifted", stage=stage, worker=peer[-8:])
                    return balancer.charge(peer, task_size)
            if peer is not None or self.stop.is_set() or time.monotonic() > deadline:
                return peer
            if time.monotonic() - self._last_discovery[stage] > 1.0:
                await self.discover(stage)
            else:
                await asyncio.sleep(WAITING_S if self._held[stage] or wait else 0.2)

    def _unavailable(self, stage: str, now: float) -> set[str]:
        """Replicas on their own counts not to send work to now: finished, or waiting in a blocking mix."""
        if self.replica_steps is None:
            return set()
        held = self._held[stage]
        for peer in [p for p, until in held.items() if until <= now]:
            del held[peer]
        return self.replica_steps[stage].done() | set(held)

    def _fail(self, stage: str, peer: str, method: str, error: BaseException) -> None:
        self.counters[stage].failures += 1
        if isinstance(error, Invalid):  # the worker produced a bad value: a fault of its own, not bad luck
            self.counters[stage].rejected += error.attributable  # as many as its faults (the run report)
            now, balancer = time.monotonic(), self.balancers[stage]
            ban_s = self.faults.record(peer, stage, error.reason, any(p != peer for p in balancer.available(now))) \
                if error.attributable else 0.0  # not attributable: bad because of what it was sent
            self.log.warning("reply rejected; " + ("worker banned" if ban_s else "nobody banned"), stage=stage,
                             method=method, worker=peer[-8:], reason=error.reason, ban_s=ban_s,
                             problem=str(error)[:200])
            if ban_s:
                balancer.ban(peer, now, ban_s)
                notice = asyncio.ensure_future(self._notice(stage, peer, f"{method}: {error}"))
                self._notices.add(notice)
                notice.add_done_callback(self._notices.discard)
            return
        self.balancers[stage].ban(peer, time.monotonic())
        self.log.warning("call failed; worker banned", stage=stage, method=method, worker=peer[-8:],
                         error=f"{type(error).__name__}: {str(error)[:200]}", ban_s=self.t.ban_s)

    async def _notice(self, stage: str, peer: str, reason: str) -> None:
        """Tell `peer` its output was rejected (its rule refused_outputs counts these); best effort."""
        try:
            await self.client.call(peer, stage, "notice", {}, {"reason": reason[:200]}, timeout=5.0)
        except Exception:
            pass
