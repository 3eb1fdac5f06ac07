"""Shard holdings and in-memory rotation (report §5.1.0.2-5.1.0.3): the model the central reference
streams by (:func:`agoractl.data.stream.run_sequences`), the epochs' shard orders, and the trainers'
progress files. A live run's ledger is the claims in the store (:mod:`agoractl.data.claims`).

The initial assignment deals the shards in order: trainer i holds shards ``order[i*p:(i+1)*p]`` for
``p = trainers.shards_per_trainer``. A holding is exhausted when fewer than ``seq_len + 1`` of its
tokens remain (the streaming reader never yields a partial sequence); a trainer is exhausted when
every holding is. Rotation gives each exhausted trainer the next ``p`` unassigned shards of the
epoch's order, in trainer order, and leaves every other trainer alone. When the order runs out the
corpus is used up; ``wrap`` starts the next epoch, whose order is a permutation of all shards drawn
from a new seed.

Each trainer also writes its own ``progress/trainer-NNNNN.json`` atomically (its stream position, read
by a resumed trainer). Everything here except those read/write helpers is a pure function of its inputs.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

import numpy as np

from agoractl import storage
from agoractl.data import remote
from agoractl.data.index import ShardIndex
from agoractl.errors import RuntimeFailure

FORMAT = "agoractl-ledger/v1"
PROGRESS_DIR = "progress"


@dataclass
class Holding:
    """One shard held by one trainer in one epoch."""

    shard: int
    epoch: int
    tokens: int
    consumed: int = 0
    skip: list[int] = field(default_factory=list)
    """Offsets (tokens from the shard's start) of sequences beyond `consumed` already read: skipped."""

    def key(self) -> tuple[int, int]:
        return (self.shard, self.epoch)

    def remaining(self) -> int:
        return self.tokens - self.consumed

    def exhausted(self, seq_len: int) -> bool:
        return self.remaining() < seq_len + 1


@dataclass
class TrainerShards:
    trainer: int
    holdings: list[Holding]

    def exhausted(self, seq_len: int) -> bool:
        return all(h.exhausted(seq_len) for h in self.holdings)


@dataclass
class Ledger:
    index: str
    """Fingerprint of the shard index this ledger belongs to."""
    seq_len: int
    shards_per_trainer: int
    seed: int
    epoch: int
    order: list[int]
    """The epoch's shard order; order[:cursor] have been handed out."""
    cursor: int
    trainers: list[TrainerShards]
    retired: list[dict[str, int]] = field(default_factory=list)
    """Holdings taken back from rotated trainers: shard, epoch, trainer, consumed."""
    generation: int = 0
    """Incremented at every rewrite."""
    format: str = FORMAT

    def trainer(self, i: int) -> Optional[TrainerShards]:
        for t in self.trainers:
            if t.trainer == i:
                return t
        return None

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, url: str = "ledger") -> "Ledger":
        try:
            raw = json.loads(data)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
            raw["trainers"] = [TrainerShards(t["trainer"], [Holding(**h) for h in t["holdings"]])
                               for t in raw["trainers"]]
            return cls(**raw)
        except (ValueError, TypeError, KeyError) as e:
            raise RuntimeFailure(f"{url}: not a valid shard ledger ({e})",
                                 hint="it was written by another version of agoractl")


def epoch_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """Epoch 0 takes the shards in order (they are pre-shuffled); later epochs a seeded permutation."""
    if epoch == 0:
        return list(range(num_shards))
    return [int(x) for x in np.random.default_rng([seed, epoch]).permutation(num_shards)]


def initial_ledger(index: ShardIndex, trainers: int, shards_per_trainer: int, seq_len: int, seed: int) -> Ledger:
    """Trainer i holds shards order[i*p:(i+1)*p]; trainers past the end of the corpus hold none."""
    order = epoch_order(index.training, seed, 0)
    entries, cursor = [], 0
    for i in range(trainers):
        take = order[cursor:cursor + shards_per_trainer]
        cursor += len(take)
        entries.append(TrainerShards(i, [Holding(s, 0, index.shards[s].tokens) for s in take]))
    return Ledger(index=index.fingerprint, seq_len=seq_len, shards_per_trainer=shards_per_trainer, seed=seed,
                  epoch=0, order=order, cursor=cursor, trainers=entries)


def fold_reports(ledger: Ledger, reports: Iterable[dict[str, Any]]) -> int:
    """Fold trainer consumption reports into the ledger (in place); returns holdings changed.

    A report is ``{"trainer": i, "holdings": [{"shard", "epoch", "consumed"}, ...]}`` (a progress file
    or a DHT record). Consumption only grows; reports about holdings the trainer no longer has (it
    was rotated since) are ignored.
    """
    changed = 0
    for report in reports:
        t = ledger.trainer(int(report.get("trainer", -1)))
        if t is None:
            continue
        consumed = {(int(h["shard"]), int(h["epoch"])): int(h["consumed"]) for h in report.get("holdings", [])}
        for h in t.holdings:
            c = min(consumed.get(h.key(), h.consumed), h.tokens)
            if c > h.consumed:
                h.consumed = c
                changed += 1
    return changed


@dataclass
class Rotation:
    """What one rotation did."""

    rotated: list[dict[str, Any]]
    """Per rotated trainer: trainer, from (shards), to (shards)."""
    starved: list[int]
    """Exhausted trainers left with no shard because the corpus is used up."""
    epoch: int
    unassigned: int
    """Shards of the current epoch not yet handed out."""

    @property
    def corpus_used_up(self) -> bool:
        return bool(self.starved)


def rotate(ledger: Ledger, index: ShardIndex, trainers: int, wrap: bool = False,
           only: Optional[set[int]] = None) -> Rotation:
    """Reassign exhausted trainers (in place; `only` restricts to those trainers).

    Trainers 0..trainers-1 missing from the ledger (the run grew) join as exhausted trainers with
    no shards. Each exhausted trainer, in trainer order, returns its holdings to ``retired`` and
    takes the next ``shards_per_trainer`` shards of the order; with `wrap`, running out of order
    starts the next epoch. A trainer that gets nothing is reported in ``starved``.
    """
    have = {t.trainer for t in ledger.trainers}
    for i in range(trainers):
        if i not in have:
            ledger.trainers.append(TrainerShards(i, []))
    ledger.trainers.sort(key=lambda t: t.trainer)
    rotated, starved = [], []
    for t in ledger.trainers:
        if (only is not None and t.trainer not in only) or not t.exhausted(ledger.seq_len):
            continue
        if not t.holdings and ledger.cursor >= len(ledger.order) and not wrap:
            starved.append(t.trainer)  # already empty and nothing to give: not a change
            continue
        old = [h.shard for h in t.holdings]
        for h in t.holdings:
            ledger.retired.append({"shard": h.shard, "epoch": h.epoch, "trainer": t.trainer, "consumed": h.consumed})
        held = set()
        new: list[Holding] = []
        while len(new) < ledger.shards_per_trainer:
            if ledger.cursor >= len(ledger.order):
                if not wrap:
                    break
                ledger.epoch += 1
                ledger.order = epoch_order(index.training, ledger.seed, ledger.epoch)
                ledger.cursor = 0
                wrap = False  # one new epoch per rotation at most
                if not ledger.order:
                    break
            s = ledger.order[ledger.cursor]
            if s in held:  # a tiny corpus wrapping onto a shard this trainer already holds
                break
            ledger.cursor += 1
            held.add(s)
            new.append(Holding(s, ledger.epoch, index.shards[s].tokens))
        t.holdings = new
        rotated.append({"trainer": t.trainer, "from": old, "to": [h.shard for h in new]})
        if not new:
            starved.append(t.trainer)
    if rotated:
        ledger.generation += 1
    return Rotation(rotated, starved, ledger.epoch, len(ledger.order) - ledger.cursor)


# -- storage -------------------------------------------------------------------------------------

def progress_url(output: str, trainer: int) -> str:
    return storage.join(output, PROGRESS_DIR, f"trainer-{trainer:05d}.json")


def write_progress(output: str, trainer: int, holdings: list[Holding], position: Any = None) -> str:
    """A trainer's consumption report, written atomically to its own file."""
    url = progress_url(output, trainer)
    body = {"trainer": trainer, "holdings": [asdict(h) for h in holdings], "position": position,
            "time": time.time()}
    remote.write_bytes(url, (json.dumps(body) + "\n").encode())
    return url


def read_progress(output: str) -> list[dict[str, Any]]:
    """Every trainer's latest report (unreadable ones are skipped: a report is advisory)."""
    url = storage.join(output, PROGRESS_DIR)
    out = []
    for name in sorted(remote.listing(url)):
        if not (name.startswith("trainer-") and name.endswith(".json")):
            continue
        try:
            out.append(json.loads(remote.read_bytes(storage.join(url, name))))
        except (OSError, ValueError):
            continue
    return out


