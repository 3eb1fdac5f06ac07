"""A trainer's shards from the claim ledger (:mod:`agoractl.data.claims`), and what it has completed of
them: the source :class:`agoractl.data.stream.TrainerStream` reads from in a live run.

The stream marks every sequence it hands out as in flight (by its offset in the shard); the trainer
settles it once the sample completed (or was given up). :meth:`ClaimSource.flush` writes, per held
claim, ``consumed`` = the offset of the first sequence still in flight (or everything read when none
is) and ``skip`` = the sequences completed beyond it, and marks a claim done once it is read to the end
and nothing of it is in flight. A trainer killed at any moment therefore leaves in the store exactly
what it completed, up to its last flush (after every completed sample); its in-flight sequences are
read again by whoever continues the shard.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from agoractl.data.claim_store import claim_store
from agoractl.data.claims import ClaimLedger, Exhausted
from agoractl.data.index import ShardIndex
from agoractl.data.ledger import Holding
from agoractl.manifest.schema import Run


class ClaimSource:
    """Claims as a :class:`~agoractl.data.stream.LedgerSource`, with in-flight bookkeeping."""

    def __init__(self, run: Run, index: ShardIndex, trainer: int, clock=time.time):
        self.ledger = ClaimLedger(claim_store(run.data.output), [s.tokens for s in index.shards[:index.training]], run.data.seed,
                                  run.data.epochs, trainer, run.data.lease_s, clock=clock)
        self.per_claim = run.trainers.shards_per_trainer
        self.seq_len = run.model.seq_len
        self.lease_s = run.data.lease_s
        self.clock = clock
        self.epochs_done: Optional[int] = None
        """Set when every allowed epoch is done (the data is exhausted)."""
        self.held: dict[tuple[int, int], Holding] = {}
        self.inflight: dict[tuple[int, int], set[int]] = {}
        self.completed: dict[tuple[int, int], set[int]] = {}
        self.lost: set[tuple[int, int]] = set()
        self.written: dict[tuple[int, int], tuple] = {}
        self.last_write: dict[tuple[int, int], float] = {}
        self.lock = threading.Lock()
        self.flush_lock = threading.Lock()
        self.track = False
        """Keep sequences in flight until settled (a trainer does); otherwise handed out = completed."""

    # -- LedgerSource ---------------------------------------------------------------------------

    def assignment(self, trainer: int) -> Optional[list[Holding]]:
        """Newly claimed shards; [] to wait (others finish the epoch); None when the data is exhausted."""
        try:
            claims = self.ledger.acquire(self.per_claim)
        except Exhausted as e:
            self.epochs_done = int(e.args[0])
            return None
        return [self._hold(Holding(c.shard, c.epoch, c.tokens, c.consumed, list(c.skip))) for c in claims]

    def adopt(self, saved: list[Holding]) -> Optional[list[Holding]]:
        """Take back the holdings of a saved position (a resumed trainer): all of them or None."""
        out = []
        for h in saved:
            h = Holding(h.shard, h.epoch, h.tokens, h.consumed, list(h.skip))
            if self.ledger.adopt(h.shard, h.epoch) is not None:
                out.append(self._hold(h))  # read to its end: the next flush marks it done
            elif h.exhausted(self.seq_len):
                out.append(h)  # done already, or another's now: nothing left to read in it anyway
            else:
                return None
        return out

    def report(self, trainer: int, holdings: list[Holding], position: Any) -> None:
        self.flush()

    def _hold(self, h: Holding) -> Holding:
        self.held[h.key()] = h
        return h

    # -- in flight ------------------------------------------------------------------------------

    def issue(self, key: tuple[int, int], offset: int) -> None:
        if not self.track:
            return
        with self.lock:
            self.inflight.setdefault(key, set()).add(offset)

    def settle(self, key: tuple[int, int], offset: int) -> None:
        with self.lock:
            self.inflight.get(key, set()).discard(offset)
            self.completed.setdefault(key, set()).add(offset)

    def is_lost(self, key: tuple[int, int]) -> bool:
        return key in self.lost

    def flush(self, force: bool = False) -> None:
        """Write every held claim whose progress changed, or whose lease is due for renewal (one flush at a
        time: the reading thread's and the trainer's may overlap)."""
        with self.flush_lock:
            self._flush(force)

    def _flush(self, force: bool) -> None:
        now = self.clock()
        for key, h in list(self.held.items()):
            with self.lock:
                flying = self.inflight.get(key, set())
                wm = min(flying) if flying else h.consumed
                done_above = {o for o in self.completed.get(key, set()) | set(h.skip) if o > wm}
                self.completed[key] = {o for o in self.completed.get(key, set()) if o > wm}
                done = not flying and h.exhausted(self.seq_len)
            state = (wm, tuple(sorted(done_above)), done)
            if not force and state == self.written.get(key) and now - self.last_write.get(key, 0) < self.lease_s / 3:
                continue
            ok = self.ledger.update(h.shard, h.epoch, h.tokens if done else wm, sorted(done_above), done)
            self.written[key], self.last_write[key] = state, now
            if not ok:
                self.lost.add(key)
            if done or not ok:
                self.held.pop(key, None)
