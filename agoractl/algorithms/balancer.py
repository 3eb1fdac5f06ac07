"""The trainer's per-stage load balancer (report §3.3.2.3): a min-heap of virtual runtime.

Each forward goes to the worker at the top of the heap (the least virtual runtime). Choosing a
worker charges it up front with the task's estimated cost, ``task size / measured throughput``, so
the key is a cumulative, speed-weighted account of the work each replica was given and faster
replicas draw more tasks. Every completed call updates the worker's throughput estimate (an
exponential moving average of samples per second). One measurement cannot starve a replica: a
worker's first measurement is blended with what its measured peers of the stage do (a first call is
often slow: connection set-up, a loaded host), not taken alone; and a completed call settles the
worker's account at its updated estimate (its virtual runtime is at most one task, at that estimate,
ahead of the least-loaded other replica), so the debt of charges made at a too-low estimate is
forgiven once it measures fast, while a replica that stays slow keeps paying its full charge. A
worker that enters — newly discovered, or back from a ban — is placed level with the most-loaded
replica present, never at zero, so it is not flooded. Failed workers are banned for
``trainers.ban_s`` seconds; workers that discovery no longer lists are dropped. A ban must not
starve a stage: when none of its workers is available, the trainer may :meth:`pardon` the banned one
whose ban ends first rather than give up a sample (a worker that was slow once, e.g. while it waited
for an averaging round, is usually fine again).

Pure: no networking and no clock of its own (every call takes ``now``), so the in-process
simulator reuses it as is. The backward pass does not come here: it is pinned to the worker that
ran the forward (report §4.2.1); the trainer asks :meth:`choose` only for a fallback.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

DEFAULT_THROUGHPUT = 1.0
"""Samples per second assumed for a worker that advertises none and has not been measured yet."""


@dataclass
class WorkerLoad:
    """What the balancer knows about one worker of the stage."""

    peer: str
    vruntime: float
    throughput: float
    measured: bool = False
    banned_until: float = float("-inf")
    chosen: int = 0
    failures: int = 0


class Balancer:
    """Virtual-runtime balancer of one stage's workers.

    :param ban_s: seconds a failed worker is skipped
    :param ema_alpha: weight of the newest throughput measurement in the moving average
    """

    def __init__(self, ban_s: float, ema_alpha: float = 0.2):
        self.ban_s, self.ema_alpha = float(ban_s), float(ema_alpha)
        self.workers: dict[str, WorkerLoad] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._order = itertools.count()
        self.bans = 0
        """Ban events so far (a report counter)."""

    # -- membership ---------------------------------------------------------------------------

    def update(self, advertised: Mapping[str, Optional[float]], now: float) -> tuple[list[str], list[str]]:
        """Replace the membership with discovery's view: peer → advertised throughput (or None).

        Newcomers enter level with the most-loaded worker; workers no longer listed are dropped
        (their ban is forgotten with them). Returns (added, removed) peer lists.
        """
        removed = [p for p in self.workers if p not in advertised]
        for p in removed:
            del self.workers[p]
        added = []
        for peer, throughput in advertised.items():
            if peer in self.workers:
                w = self.workers[peer]
                if not w.measured and throughput:
                    w.throughput = float(throughput)
                continue
            self._enter(peer, float(throughput) if throughput else DEFAULT_THROUGHPUT, now)
            added.append(peer)
        return added, removed

    def _enter(self, peer: str, throughput: float, now: float) -> None:
        level = self._max_load(now)
        self.workers[peer] = WorkerLoad(peer, level, throughput)
        self._push(peer, level)

    def _max_load(self, now: float) -> float:
        loads = [w.vruntime for w in self.workers.values() if not self.is_banned(w.peer, now)]
        return max(loads, default=0.0)

    def _push(self, peer: str, vruntime: float) -> None:
        heapq.heappush(self._heap, (vruntime, next(self._order), peer))

    # -- choosing -----------------------------------------------------------------------------

    def choose(self, now: float, task_size: float = 1.0, exclude: Iterable[str] = ()) -> Optional[str]:
        """The least-loaded available worker, charged `task_size / throughput` up front; None if none.

        Banned workers and those in `exclude` (e.g. the ones a retry already failed on) are skipped.
        A worker whose ban has expired re-enters level with the most-loaded one.
        """
        excluded = set(exclude)
        for w in self.workers.values():
            if w.banned_until != float("-inf") and now >= w.banned_until:
                w.banned_until = float("-inf")
                w.vruntime = max(w.vruntime, self._max_load(now))
                self._push(w.peer, w.vruntime)
        skipped: list[tuple[float, int, str]] = []
        chosen: Optional[WorkerLoad] = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            vruntime, _, peer = entry
            w = self.workers.get(peer)
            if w is None or vruntime != w.vruntime:
                continue  # stale entry: the worker left, or was charged since this entry was pushed
            if peer in excluded or self.is_banned(peer, now):
                skipped.append(entry)
                continue
            chosen = w
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if chosen is None:
            return None
        return self.charge(chosen.peer, task_size)

    def charge(self, peer: str, task_size: float = 1.0) -> str:
        """Charge `peer` for a task sent to it (by :meth:`choose`, or chosen by another rule:
        :class:`~agoractl.algorithms.routing.ReplicaRoute`), so the accounts stay right for later choices."""
        chosen = self.workers[peer]
        chosen.vruntime += task_size / max(chosen.throughput, 1e-9)
        chosen.chosen += 1
        self._push(chosen.peer, chosen.vruntime)
        return chosen.peer

    # -- outcomes -----------------------------------------------------------------------------

    def record_success(self, peer: str, task_size: float, elapsed_s: float) -> None:
        """A call to `peer` of `task_size` samples took `elapsed_s` seconds: update its throughput and settle
        its account.

        The estimate is a moving average; a first measurement starts from the median of the stage's measured
        peers (the sample alone when none is measured yet), so one slow call cannot price a replica out.
        Settling: a worker is never more than one task (at its updated estimate) ahead of the least-loaded
        other available worker, the most it can lead when its charges were right (it was chosen as the
        minimum, then charged once); a lead beyond that came from charges at a too-low estimate.
        """
        w = self.workers.get(peer)
        if w is None or elapsed_s <= 0:
            return
        sample = task_size / elapsed_s
        if not w.measured:
            peers = sorted(o.throughput for o in self.workers.values() if o.measured and o is not w)
            w.throughput = peers[len(peers) // 2] if peers else sample
            w.measured = True
        w.throughput = self.ema_alpha * sample + (1 - self.ema_alpha) * w.throughput
        others = [o.vruntime for o in self.workers.values() if o is not w and o.banned_until == float("-inf")]
        if others:
            cap = min(others) + task_size / max(w.throughput, 1e-9)
            if w.vruntime > cap:
                w.vruntime = cap
                self._push(peer, cap)

    def refund(self, peer: str, task_size: float) -> None:
        """Take back the charge of a call `peer` answered without doing the work (a replica waiting in a blocking
        mix, or one that took its last step): it did not take the task, so it owes nothing for it."""
        w = self.workers.get(peer)
        if w is not None:
            w.vruntime -= task_size / max(w.throughput, 1e-9)
            self._push(peer, w.vruntime)

    def ban(self, peer: str, now: float, duration: Optional[float] = None) -> None:
        """Skip `peer` for `duration` seconds (default ban_s; counted in :attr:`bans`). Unknown peers are
        remembered too, so that a failed worker discovery still lists is not chosen again."""
        w = self.workers.get(peer)
        if w is None:
            w = self.workers[peer] = WorkerLoad(peer, self._max_load(now), DEFAULT_THROUGHPUT)
        w.banned_until = max(w.banned_until, now + (self.ban_s if duration is None else float(duration)))
        w.failures += 1
        self.bans += 1

    def pardon(self, now: float, exclude: Iterable[str] = ()) -> Optional[str]:
        """Lift the ban of the listed worker (not in `exclude`) whose ban ends first, and return it; None when
        no banned worker is listed. For a stage with no available worker: the last resort before a lost sample."""
        banned = [w for w in self.workers.values() if w.peer not in set(exclude) and self.is_banned(w.peer, now)]
        if not banned:
            return None
        w = min(banned, key=lambda w: w.banned_until)
        w.banned_until = float("-inf")
        w.vruntime = max(w.vruntime, self._max_load(now))
        self._push(w.peer, w.vruntime)
        return w.peer

    def is_banned(self, peer: str, now: float) -> bool:
        w = self.workers.get(peer)
        return w is not None and now < w.banned_until

    def available(self, now: float) -> list[str]:
        """Peers that may be chosen now (present and not banned)."""
        return [p for p in self.workers if not self.is_banned(p, now)]

    def __len__(self) -> int:
        return len(self.workers)
