"""The shard ledger as claims in the store: trainers on different hosts take shards one claim at a
time, never the same shard twice (report §3.7, §5.1.0.3).

Layout under ``<data.output>/claims/``: ``epoch-EEEEE/shard-SSSSS.json``, one object per shard read
in an epoch, and ``epochs.json`` (an operator's ``rotate-shards --wrap``: more epochs than the
manifest's ``data.epochs``). A claim names its trainer (ledger index), its owner (one id per
trainer process), ``lease_until`` (wall time), ``consumed`` (tokens up to the trainer's first
sequence not yet completed) and ``skip`` (offsets of sequences completed beyond that, while an
earlier one was still in flight), and ``done``.

- **Claiming** creates the object only if absent (:mod:`agoractl.data.claim_store`: S3
  ``If-None-Match: *``, locally a hard link): of two trainers racing for a shard exactly one wins;
  the loser lists the epoch again and tries the next shard of its order not claimed yet.
- **Progress and leases** are compare-and-swap rewrites (S3 ``If-Match``, locally flock +
  rename) by the holder, after every completed sample and at least every ``lease_s / 3``.
- **A dead trainer's shard**: once ``lease_until`` has passed, any trainer may take the claim over by
  the same compare-and-swap; it keeps ``consumed`` and ``skip``, so the reader continues with the
  first sequence the dead trainer had not completed (its in-flight ones are read again; nothing it
  completed is). A trainer restarted with the same ledger index adopts its own claims at once.
- **Epochs**: epoch ``e``'s order is :func:`agoractl.data.ledger.epoch_order` (the stored order for
  epoch 0, a permutation drawn from the seed after). No shard of epoch ``e + 1`` is claimed before
  every shard of epoch ``e`` is done, so a trainer whose epoch is fully claimed waits for the others'
  last shards (or their leases). After ``data.epochs`` epochs the data is exhausted.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from agoractl.data.claim_store import ClaimStore
from agoractl.data.ledger import epoch_order

FORMAT = "agoractl-claim/v1"
CLAIMS_DIR = "claims"


def shard_name(epoch: int, shard: int) -> str:
    return f"epoch-{epoch:05d}/shard-{shard:05d}.json"


@dataclass
class Claim:
    shard: int
    epoch: int
    tokens: int
    trainer: int
    owner: str
    lease_until: float
    consumed: int = 0
    skip: list[int] = field(default_factory=list)
    done: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)
    """Earlier holders: trainer, owner, consumed when taken over, time."""
    claimed_at: float = 0.0
    """Wall time the shard was first claimed in this epoch."""
    done_at: Optional[float] = None
    """Wall time the last sequence of it completed."""
    format: str = FORMAT

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Claim":
        return cls(**json.loads(data))


class Exhausted(Exception):
    """Every allowed epoch is done."""


class ClaimLedger:
    """One trainer's view of the ledger; every write is atomic in the store.

    :param tokens: tokens per shard (the shard index)
    :param clock: wall time (tests drive it)
    """

    def __init__(self, store: ClaimStore, tokens: list[int], seed: int, epochs: int, trainer: int,
                 lease_s: float, owner: Optional[str] = None, clock: Callable[[], float] = time.time):
        self.store, self.tokens, self.seed, self.epochs = store, list(tokens), seed, epochs
        self.trainer, self.lease_s, self.clock = trainer, lease_s, clock
        self.owner = owner or uuid.uuid4().hex[:16]
        self.tags: dict[tuple[int, int], str] = {}
        """Held claims: (shard, epoch) -> the store's tag of our last write."""
        self.history: dict[tuple[int, int], list] = {}
        self.claimed_at: dict[tuple[int, int], float] = {}

    # -- reading ------------------------------------------------------------------------------

    def allowed_epochs(self) -> int:
        got = self.store.read(f"{CLAIMS_DIR}/epochs.json")
        return max(self.epochs, int(json.loads(got[0]).get("epochs", 0))) if got else self.epochs

    def epoch_names(self, epoch: int) -> tuple[set[int], set[int]]:
        """(claimed shards, done shards) of an epoch, from one listing (a done claim leaves a marker)."""
        claimed, done = set(), set()
        for name in self.store.names(f"{CLAIMS_DIR}/epoch-{epoch:05d}"):
            kind, _, num = name[:-5].partition("-")
            (claimed if kind == "shard" else done if kind == "done" else set()).add(int(num))
        return claimed, done

    def read_claims(self, epoch: int, shards) -> dict[int, tuple[Claim, str]]:
        out = {}
        for s in sorted(shards):
            got = self.store.read(f"{CLAIMS_DIR}/{shard_name(epoch, s)}")
            if got is not None:
                out[s] = (Claim.from_json(got[0]), got[1])
        return out

    def current_epoch(self) -> tuple[int, set[int], set[int]]:
        """The first epoch not every shard of which is done, its claimed and done shards; Exhausted past
        the last allowed epoch."""
        allowed = self.allowed_epochs()
        for e in range(allowed):
            claimed, done = self.epoch_names(e)
            if len(done) < len(self.tokens):
                return e, claimed, done
        raise Exhausted(allowed)

    # -- claiming -----------------------------------------------------------------------------

    def _new(self, shard: int, epoch: int) -> Claim:
        now = self.clock()
        return Claim(shard, epoch, self.tokens[shard], self.trainer, self.owner, now + self.lease_s, claimed_at=now)

    def acquire(self, n: int) -> list[Claim]:
        """Up to `n` claims of the current epoch: unclaimed shards in the epoch's order (from position ``trainer * n`` on, wrapping, so that
        trainers starting together rarely race for one shard), then claims of this trainer index (a restarted
        process) or with an expired lease (continued where their holder stopped). An empty list means: wait (the epoch's last shards are held by live trainers).
        Raises Exhausted when every allowed epoch is done. A lost race re-reads the epoch's claimed shards, so
        claimants starting together cost a few requests each, not one failed create per shard taken."""
        epoch, claimed, done = self.current_epoch()
        got: list[Claim] = []
        open_ = [s for s in claimed - done if (s, epoch) not in self.tags]
        order = epoch_order(len(self.tokens), self.seed, epoch)
        start = (self.trainer * n) % max(1, len(order))  # trainer i tries its own stretch first: less contention
        for shard in order[start:] + order[:start]:
            if len(got) >= n:
                break
            if shard in claimed:
                continue
            c = self._new(shard, epoch)
            tag = self.store.create(f"{CLAIMS_DIR}/{shard_name(epoch, shard)}", c.to_json())
            if tag is not None:
                self.tags[(shard, epoch)] = tag
                self.claimed_at[(shard, epoch)] = c.claimed_at
                got.append(c)
            else:  # lost a race: look again (one LIST) rather than lose one more per shard others took meanwhile
                claimed |= self.epoch_names(epoch)[0]
        if len(got) < n and open_:
            now = self.clock()
            for shard, (c, tag) in self.read_claims(epoch, [s for s in open_ if (s, epoch) not in self.tags]).items():
                if len(got) < n and not c.done and (c.lease_until < now or c.trainer == self.trainer):
                    taken = self._take_over(c, tag)
                    if taken is not None:
                        got.append(taken)
        return got

    def _take_over(self, c: Claim, tag: str) -> Optional[Claim]:
        new = Claim(**{**asdict(c), "trainer": self.trainer, "owner": self.owner,
                       "lease_until": self.clock() + self.lease_s,
                       "history": [*c.history, {"trainer": c.trainer, "owner": c.owner, "consumed": c.consumed,
                                                "time": self.clock()}]})
        got = self.store.replace(f"{CLAIMS_DIR}/{shard_name(c.epoch, c.shard)}", new.to_json(), tag)
        if got is None:
            return None
        self.tags[(c.shard, c.epoch)] = got
        self.history[(c.shard, c.epoch)] = new.history
        self.claimed_at[(c.shard, c.epoch)] = c.claimed_at
        return new

    def adopt(self, shard: int, epoch: int) -> Optional[Claim]:
        """Take (shard, epoch) for a resumed trainer: its own claim, an expired one, or an unclaimed shard."""
        name = f"{CLAIMS_DIR}/{shard_name(epoch, shard)}"
        got = self.store.read(name)
        if got is None:
            c = self._new(shard, epoch)
            tag = self.store.create(name, c.to_json())
            if tag is None:
                return None
            self.tags[(shard, epoch)] = tag
            self.claimed_at[(shard, epoch)] = c.claimed_at
            return c
        c = Claim.from_json(got[0])
        if c.done or not (c.trainer == self.trainer or c.lease_until < self.clock()):
            return None
        return self._take_over(c, got[1])

    def update(self, shard: int, epoch: int, consumed: int, skip: list[int], done: bool) -> bool:
        """Record progress on a held claim and renew its lease (one conditional write); False when the
        claim was lost (our lease expired and another trainer took it over): stop reading it."""
        key = (shard, epoch)
        if key not in self.tags:
            return False
        c = self._new(shard, epoch)
        c.consumed, c.skip, c.done, c.history = consumed, sorted(skip), done, self.history.get(key, [])
        c.claimed_at, c.done_at = self.claimed_at.get(key, c.claimed_at), (self.clock() if done else None)
        tag = self.store.replace(f"{CLAIMS_DIR}/{shard_name(epoch, shard)}", c.to_json(), self.tags[key])
        if tag is None or done:
            self.tags.pop(key, None)
            if tag is not None:  # the marker lets a listing tell done shards without reading them
                self.store.create(f"{CLAIMS_DIR}/epoch-{epoch:05d}/done-{shard:05d}.json", b"{}")
            return tag is not None
        self.tags[key] = tag
        return True


def release_trainer(store: ClaimStore, trainer: int) -> list[tuple[int, int]]:
    """An operator's release of a (dead) trainer's claims: their leases end now, so the next trainer takes
    them over (continuing where it stopped). Returns the (shard, epoch) released."""
    out, e = [], -1
    while True:
        e += 1
        names = store.names(f"{CLAIMS_DIR}/epoch-{e:05d}")
        if not names:
            break
        for name in names:
            got = store.read(f"{CLAIMS_DIR}/epoch-{e:05d}/{name}") if name.startswith("shard-") else None
            if got is None:
                continue
            c = Claim.from_json(got[0])
            if c.trainer == trainer and not c.done:
                c.lease_until = 0.0
                if store.replace(f"{CLAIMS_DIR}/{shard_name(c.epoch, c.shard)}", c.to_json(), got[1]) is not None:
                    out.append((c.shard, c.epoch))
    return out


def allow_epochs(store: ClaimStore, epochs: int) -> int:
    """Raise the ledger's epoch count to `epochs` (an operator's forced wrap); returns the count now."""
    name = f"{CLAIMS_DIR}/epochs.json"
    while True:
        got = store.read(name)
        have = int(json.loads(got[0]).get("epochs", 0)) if got else 0
        if have >= epochs:
            return have
        body = json.dumps({"epochs": epochs}).encode()
        if (store.replace(name, body, got[1]) if got else store.create(name, body)) is not None:
            return epochs


def ledger_state(store: ClaimStore, num_shards: int, epochs: int, clock: Callable[[], float] = time.time
                 ) -> dict[str, Any]:
    """What the ledger holds: per epoch, claims (trainer, consumed, done, expired)."""
    out: list[dict[str, Any]] = []
    e = 0
    while True:
        names = store.names(f"{CLAIMS_DIR}/epoch-{e:05d}")
        if not names:
            break
        claims = []
        for name in names:
            got = store.read(f"{CLAIMS_DIR}/epoch-{e:05d}/{name}") if name.startswith("shard-") else None
            if got is not None:
                c = Claim.from_json(got[0])
                claims.append({"shard": c.shard, "trainer": c.trainer, "consumed": c.consumed, "tokens": c.tokens,
                               "done": c.done, "expired": not c.done and c.lease_until < clock(),
                               "claimed_at": c.claimed_at, "done_at": c.done_at,
                               "takeovers": len(c.history)})
        out.append({"epoch": e, "claimed": len(claims), "done": sum(c["done"] for c in claims),
                    "unclaimed": num_shards - len(claims), "claims": claims})
        e += 1
    got = store.read(f"{CLAIMS_DIR}/epochs.json")
    allowed = max(epochs, int(json.loads(got[0]).get("epochs", 0))) if got else epochs
    return {"epochs": out, "allowed_epochs": allowed}
