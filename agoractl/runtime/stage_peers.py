"""How many replicas of a worker's stage are alive, read from the DHT by a watcher thread.

Averaging (SPARTA rounds, FGDiLoCo mixes) waits for this many peers before a group forms. A record
missing from one read (a slow store, a partial answer) is not a departure: a worker counts the
peers seen within a record's lifetime (three announce periods, at least 5 s), itself included
even before its own record propagates. A failed read keeps the last view (the self-termination
``dht`` rule watches connectivity).

It also tells how long the stage has had no other *serving* replica (one past weight sync,
:data:`~agoractl.runtime.records.SERVING_PHASES`): a joiner in a sync phase with none left goes
active, and a round that failed with none to average with is not counted against this worker. And which
SPARTA round each serving replica announces it is averaging (its record's ``round``): a round that formed
no group while the others were all in other rounds is not this worker's failure either.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from agoractl.runtime.records import SERVING_PHASES

WATCH_PERIOD_S = 1.0
"""Seconds between the watcher's DHT reads."""
KEPT_ROUNDS = 16
"""Rounds for which the watcher remembers which replicas announced them (:meth:`StagePeers.seen_in_round`)."""


class StagePeers:
    """The live replicas of `stage` as seen by `peer`; :meth:`start` the watcher, :meth:`stop` it."""

    def __init__(self, records, stage: str, peer: str, announce_period_s: float,
                 on_read: Optional[Callable[[], None]] = None):
        self.records, self.stage, self.peer = records, stage, peer
        self.horizon_s = max(5.0, 3 * announce_period_s)
        self.on_read = on_read
        """Called after every read, on the watcher thread (other DHT reads that share its cadence)."""
        self.live = 1
        """Replicas of the stage seen within a record's lifetime, this worker included."""
        self.others_now = 0
        """Other replicas in the latest read (no memory of earlier reads)."""
        self.operators_now: set[str] = set()
        """Operator replicas in the latest read."""
        self.serving_others_now = 0
        """Other replicas in the latest read that serve (past weight sync)."""
        self.rounds_now: dict[str, int] = {}
        """The SPARTA round each other serving replica of the latest read announced it is averaging."""
        self._in_round: dict[int, set[str]] = {}
        self._first_read: Optional[float] = None
        self._serving_seen: Optional[float] = None
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def read(self) -> None:
        current = self.records.stage_workers(self.stage)
        with self._lock:  # the watcher and a round's live_now may read at once
            self._take(current)

    def _take(self, current: dict) -> None:
        now = time.monotonic()
        self.others_now = len(set(current) - {self.peer})
        self.operators_now = {peer for peer, rec in current.items() if getattr(rec, "role", None) == "operator"}
        serving = [p for p, rec in current.items()
                   if p != self.peer and getattr(rec, "phase", None) in SERVING_PHASES]
        self.serving_others_now = len(serving)
        self.rounds_now = {p: int(current[p].round) for p in serving if getattr(current[p], "round", None) is not None}
        for p, r in self.rounds_now.items():
            self._in_round.setdefault(r, set()).add(p)
        for r in sorted(self._in_round)[:-KEPT_ROUNDS]:
            del self._in_round[r]
        if self._first_read is None:
            self._first_read = now
        if serving:
            self._serving_seen = now
        for peer in current:
            self.seen[peer] = now
        self.seen[self.peer] = now
        self.live = sum(now - t <= self.horizon_s for t in self.seen.values())

    def live_now(self) -> int:
        """:attr:`live`, read afresh from the DHT when the last view has this worker alone: a round due before
        the watcher's first read of a peer (a whole-model replica takes H steps in under a second) must not
        skip its mix while the peer waits for it. A failed read keeps the last view."""
        if self.live < 2:
            try:
                self.read()
            except Exception:
                pass
        return self.live

    def live_ids(self) -> list[str]:
        """Peer ids of the replicas counted in :attr:`live` (this worker included), sorted; read afresh like
        :meth:`live_now` when the last view has this worker alone (the direct mixing transport's partners)."""
        self.live_now()
        with self._lock:
            now = time.monotonic()
            return sorted(p for p, t in self.seen.items() if now - t <= self.horizon_s)

    def alone_for_s(self) -> float:
        """Seconds for which no read has shown another serving replica of the stage (counted from the first
        read when none ever did; 0 before any read)."""
        with self._lock:
            since = self._serving_seen if self._serving_seen is not None else self._first_read
            return 0.0 if since is None else time.monotonic() - since

    def alone(self) -> bool:
        """No other serving replica for a record's whole lifetime (a record missing from one read is not a
        departure)."""
        return self.alone_for_s() >= self.horizon_s

    def seen_in_round(self, round_index: int) -> set[str]:
        """The other serving replicas that any read showed averaging round `round_index` (rounds only go up)."""
        with self._lock:
            return set(self._in_round.get(round_index, ()))

    def first_operator(self) -> bool:
        """Whether this worker is the stage's first operator (the lowest peer id among the operators
        of the latest read, itself included): the one replica that publishes the stage checkpoints,
        so that replicas never write the same checkpoint at once."""
        return self.peer == min(self.operators_now | {self.peer})

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self.read()
                if self.on_read is not None:
                    self.on_read()
            except Exception:  # a slow DHT: keep the last view
                pass
            self._stop.wait(WATCH_PERIOD_S)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name=f"{self.stage}-peers", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # usually between DHT calls; a slow call is not waited for
