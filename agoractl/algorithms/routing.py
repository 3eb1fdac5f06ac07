"""Which replica trains a trainer's samples when replicas step on their own counts (seed 002's inner steps).

With ``data_parallel.fgdiloco.replicas`` = M each whole-model replica takes an inner step every
``b = global_batch_size / M`` samples of its own. The virtual-runtime balancer
(:mod:`agoractl.algorithms.balancer`) would hand each replica whatever it is quickest to serve, so which samples
make up a replica's inner step changes from run to run, and the swarm cannot be compared with ``agoractl
simulate`` on the same data. :class:`ReplicaRoute` splits the trainer's stream as the simulator does instead:
the trainer's samples are cut into consecutive blocks of ``b`` (its ``s``-th sample since it started is in block
``s // b``), and block ``n`` goes to the replica of rank ``n mod R`` among the stage's R replicas sorted by
peer id (R = M when every replica serves). With one trainer, replica r's inner step j is then exactly the
stream's samples ``[(j M + r) b, (j M + r + 1) b)``, the simulator's split.

A replica's blocks are sent to it in the order they were drawn: a request waits while a sample of an earlier
block of the same replica is not on its way (concurrent requests queued behind a blocking mix, or drawn by
concurrent pipelines, would otherwise race for it, and a later block could make up an earlier inner step). The
trainer draws its samples in order and reports every request it sends or gives up (:meth:`ReplicaRoute.forget`),
so such a wait ends. No stall and no lost sample for it: a replica that
answered "waiting" (it sits in a blocking mix, which ends by itself) is waited for, up to ``hold_s`` (how long a
mix may last); one that finished, was banned, failed this
request or stayed held longer gives way to any other available replica, the balancer's choice (a fallback,
which the trainer counts). Pure: no networking and no clock of its own (every call takes ``now``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(frozen=True)
class Decision:
    """What to do with one request: send it to `peer`; or `wait` for the assigned replica (held in a blocking
    mix) and ask again; or neither: fall back to the balancer's choice among the other available replicas."""

    peer: Optional[str] = None
    wait: bool = False

    @property
    def fallback(self) -> bool:
        return self.peer is None and not self.wait


class ReplicaRoute:
    """The deterministic split of one trainer's samples among a stage's replicas (see the module docstring).

    :param block: samples per replica inner step (``global_batch_size / M``)
    :param hold_s: seconds a replica held in a blocking mix is waited for before its samples go elsewhere
    """

    def __init__(self, block: int, hold_s: float):
        if block < 1:
            raise ValueError(f"block must be at least 1; got {block}")
        self.block, self.hold_s = int(block), float(hold_s)
        self._held_since: dict[str, float] = {}
        self._queued: dict[int, str] = {}  # requests waiting for their held replica: first sample -> replica
        self._sent: set[int] = set()  # samples at or above _floor on their way (or given up)
        self._floor = 0  # every sample below it is on its way (or given up)

    def assigned(self, sample: int, members: Iterable[str]) -> Optional[str]:
        """The replica the request starting at the trainer's `sample`-th sample (0-based) belongs to; None when
        the stage has no member."""
        ranked = sorted(set(members))
        return ranked[(sample // self.block) % len(ranked)] if ranked else None

    def decide(self, sample: int, members: Iterable[str], unusable: Iterable[str], held: Iterable[str],
               now: float, size: int = 1) -> Decision:
        """Where the request of `size` samples starting at `sample` goes now.

        :param members: the stage's replicas as discovery lists them (banned ones included: the ranking does
                        not shift when one is banned for a while)
        :param unusable: replicas not to send it to (banned, finished, already failed on this request)
        :param held: replicas that answered "waiting" (in a blocking mix) and are not to be asked yet
        """
        ranked = sorted(set(members))
        peer = ranked[(sample // self.block) % len(ranked)] if ranked else None
        since = None if peer is None else self._held_since.get(peer)
        if peer is None or peer in set(unusable) or (since is not None and now - since >= self.hold_s):
            self.forget(sample, size)
            return Decision()  # held longer than a mix may last: the balancer's choice meanwhile
        if peer in set(held) or self._earlier(sample, peer, ranked):
            self._queued[sample] = peer
            return Decision(wait=True)
        self.forget(sample, size)
        return Decision(peer=peer)

    def _earlier(self, sample: int, peer: str, ranked: list[str]) -> bool:
        """Whether a sample of an earlier block of `peer` is not on its way yet: drawn but not sent, or waiting
        for the replica's mix to end. A replica's blocks reach it in the order the trainer drew them (requests
        queued behind a blocking mix, or drawn by concurrent pipelines, would otherwise race for it, and a later
        block could make up an earlier inner step)."""
        block = sample // self.block
        if any(s // self.block < block and p == peer for s, p in self._queued.items()):
            return True
        return any(x not in self._sent and ranked[(x // self.block) % len(ranked)] == peer
                   for x in range(self._floor, block * self.block))

    def forget(self, sample: int, size: int = 1) -> None:
        """The request of `size` samples starting at `sample` is on its way, or done with (fallen back, given up):
        later requests for its replica no longer wait for it."""
        self._queued.pop(sample, None)
        self._sent.update(range(sample, sample + max(1, size)))
        while self._floor in self._sent:
            self._sent.discard(self._floor)
            self._floor += 1

    def waiting(self, peer: str, now: float) -> None:
        """`peer` answered "waiting": it is in a blocking mix since `now` (unless it already was)."""
        self._held_since.setdefault(peer, now)

    def served(self, peer: str) -> None:
        """`peer` trained a request: whatever mix held it is over."""
        self._held_since.pop(peer, None)
