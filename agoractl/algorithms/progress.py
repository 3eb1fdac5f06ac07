"""When the replicas of a stage step: collective progress toward the global batch (report §3.2, §3.3.1).

Every replica counts the samples whose backward it ran — a cumulative ``total`` — and publishes
``(step, total)`` in the DHT. A replica's view of the stage's cumulative count is its own total plus
the last total it saw from every peer (a peer that left keeps its last count: its samples happened).
Step ``t`` (0-based) is complete when the stage has seen ``(t + 1) x training.global_batch_size``
samples, so a replica steps when

- its view of the stage's count reaches the end of its current step's batch, or
- some replica is already at a later step (it saw the batch first, or this replica just joined),

and every replica takes one step per collective batch. Because counts are cumulative, samples that
arrive while the news of a step is still travelling through the DHT count toward the next step
instead of inflating the current one, so the stage applies ``global_batch_size`` samples per step on
average whatever the DHT's latency. A replica alone in its stage knows the count exactly: a pure
pipeline steps every ``global_batch_size`` samples, like the centralized reference, and
:meth:`StageProgress.room` lets the compute loop stop a coalesced batch at the step boundary.

With ``own`` (FGDiLoCo with ``data_parallel.fgdiloco.replicas`` = M, seed 002's inner steps), a replica
steps on its own count instead: every ``target`` = global_batch_size / M samples it ran, whatever its peers
did, so each step's global batch is exact (M x target) and replicas meet only at the outer rounds' mixes.

Pure: the DHT transport lives in :mod:`agoractl.runtime.records`; this module only decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional


@dataclass(frozen=True)
class PeerProgress:
    """One replica's published progress: its step, its cumulative samples, and its view of the stage's
    cumulative samples (:meth:`StageProgress.stage_total`; 0 from a replica that does not say)."""

    step: int
    total: int
    seen: int = 0


class StageProgress:
    """A replica's view of its stage's progress.

    :param target: samples per optimizer step, counted over all replicas (global batch size)
    :param max_steps: the step counter never goes past this
    :param step: the step to start at (a joining replica takes the stage's current step)
    :param restarts: the stage itself restarts at `step` (a run resumed from its checkpoints, no replica
                     running): the samples of the steps before it count as seen, or a replica alone in
                     its stage would take ``(step + 1) x target`` samples for its first step
    :param seen: the samples the stage had seen when this replica started, where no replica of the stage is
                 left to say it: a stage that lost every replica mid-run rejoins at the run's count (another
                 stage's, :attr:`PeerProgress.seen`), so its steps take the same samples as the other stages'
    :param own: step on this replica's own count (`target` samples per step), never on its peers'
    """

    def __init__(self, target: int, max_steps: int, step: int = 0, restarts: bool = False,
                 seen: Optional[int] = None, own: bool = False):
        self.target, self.max_steps = int(target), int(max_steps)
        self.step = int(step)
        self.samples = 0
        """Samples accumulated toward this replica's current step (its gradient's sample count)."""
        self.total = 0
        """Samples this replica ran the backward of, since it started."""
        self.peer_totals: dict[str, int] = {}
        """The last cumulative count seen from every peer, departed ones included."""
        self.peers: dict[str, int] = {}
        """Step of every peer currently publishing."""
        self.own = bool(own)
        self._base = self.step * self.target  # a joiner counts from its starting step
        self._origin = self._base if own else int(seen) if seen is not None else self._base if restarts else 0
        """Samples the stage had seen before any replica now counting started (a restarted stage's steps)."""
        self._joining = not own and seen is None and not restarts and self.step > 0
        """A joiner of a running stage: its origin is set at its first view of the peers (:meth:`observe`)."""

    def observe(self, peers: Mapping[str, PeerProgress]) -> None:
        """Take in the other replicas' records (this replica's own must be left out).

        A joiner's first view of its peers sets where it counts from: the stage's samples as far as the peers
        know (their published :attr:`PeerProgress.seen`, at least its starting step's), less their totals. The
        peers' totals alone miss the replicas that left before it came: counting from them, it took the samples
        of their share again toward its steps (a head joiner in the churn test took 517 samples for one step)."""
        totals = dict(self.peer_totals)  # replaced whole, like :meth:`heard`'s
        for peer, p in peers.items():
            totals[peer] = max(totals.get(peer, 0), int(p.total))
        self.peer_totals = totals
        self.peers = {peer: int(p.step) for peer, p in peers.items()}
        if self._joining and peers:
            self._joining = False
            known = sum(self.peer_totals.values())
            self._origin = max(self._base, known, *(int(p.seen) for p in peers.values())) - known

    def heard(self, peer: str, p: PeerProgress) -> None:
        """Take in one replica's progress pushed straight to this one (:mod:`agoractl.runtime.progress_push`),
        between DHT reads: its count only moves forward (a step read late only delays :meth:`ahead`). A joiner
        ignores pushes until its first view of the peers, from which it sets where it counts from (:meth:`observe`).
        The dicts are replaced, not changed in place: the compute thread reads them while another thread writes."""
        if self._joining or self.own:
            return
        self.peer_totals = {**self.peer_totals, peer: max(self.peer_totals.get(peer, 0), int(p.total))}
        self.peers = {**self.peers, peer: int(p.step)}

    def add(self, samples: int, report: bool = True) -> None:
        """This replica accumulated gradients of `samples` more samples; unless `report`, they do not
        count toward the stage's batch (a worker in a sync phase, report §3.3.1.1)."""
        self.samples += int(samples)
        if report:
            self.total += int(samples)

    def contributions(self, me: str) -> dict[str, int]:
        """Cumulative samples of every live replica (the peers now publishing, and this one as `me`)."""
        return {**{peer: self.peer_totals.get(peer, 0) for peer in self.peers}, me: self.total}

    def stage_total(self) -> int:
        """This replica's view of the samples the stage has seen."""
        return self._origin + self.total + sum(self.peer_totals.values())

    def collective(self) -> int:
        """Samples the stage has seen toward the current step's batch (beyond it once complete); with `own`,
        the samples this replica ran toward its own current step."""
        if self.own:
            return self._origin + self.total - self.step * self.target
        return max(self.stage_total(), self._base) - self.step * self.target

    def own_share(self) -> float:
        """This replica's share of the samples that the stage's live replicas ran (itself included): roughly its
        share of the stage's work in flight too. 1.0 alone, or before it ran any (a newcomer)."""
        live = sum(self.peer_totals.get(peer, 0) for peer in self.peers)
        return self.total / (self.total + live) if self.total else 1.0

    def ahead(self) -> bool:
        """Whether another replica already took the current step (never a reason to step with `own`)."""
        return not self.own and any(s > self.step for s in self.peers.values())

    def room(self) -> int:
        """Samples still missing from the current step's batch (0 when it is complete)."""
        return max(0, self.target - self.collective())

    @property
    def finished(self) -> bool:
        return self.step >= self.max_steps

    def should_step(self) -> bool:
        return not self.finished and (self.ahead() or self.collective() >= self.target)

    def advance(self) -> int:
        """Take the step: the counter moves on and local accumulation restarts; returns the samples
        this replica contributed to the step."""
        contributed = self.samples
        self.step += 1
        self.samples = 0
        return contributed

    def stage_step(self) -> int:
        """The furthest step any replica (this one included) has reached: where a newcomer starts."""
        return max([self.step, *self.peers.values()])


def run_position(others: Iterable[PeerProgress]) -> Optional[PeerProgress]:
    """Where the run is, for a stage with no replica left: the furthest step and stage sample count that the
    other stages' replicas published (`others`; every sample passes every stage, so one count serves all).
    None when none of them has trained yet: the run is starting, not going on."""
    found = list(others)
    if not any(p.step or p.seen for p in found):
        return None
    return PeerProgress(max(p.step for p in found), max(p.total for p in found), max(p.seen for p in found))


PUBLISH_SHARE = 0.1
"""A replica publishes the stage's checkpoints only if it ran at least this share of the samples of the replica
that ran the most (:func:`checkpoint_publisher`)."""


def checkpoint_publisher(totals: Mapping[str, int], share: float = PUBLISH_SHARE) -> Optional[str]:
    """The one replica of a stage that publishes its checkpoints, every replica deciding alike from the same
    counts: the smallest peer id among those whose cumulative samples (`totals`: live replicas, peer id ->
    :attr:`StageProgress.total`, as published) reach `share` of the largest. A replica the trainers banned or
    never used — a faulty or hostile one, refused from its first requests — runs next to none of the stage's
    samples and never becomes the publisher while one that trained is live: in the faulty-nodes benchmark, a
    banned head replica with 3 samples (against some 500 for each honest one) had the smallest peer id and
    published the last checkpoint, its weights untrained, and the run's held-out loss was 3.35 instead of 2.0.
    None when `totals` is empty."""
    if not totals:
        return None
    floor = share * max(totals.values())
    return min(peer for peer, total in totals.items() if total >= floor)


class ReplicaSteps:
    """A trainer's view of one stage whose replicas step on their own counts (:class:`StageProgress` with
    ``own``): the furthest step seen from each replica, from its records and its replies, and when it was last
    heard of. Such a stage is finished once every replica it has heard of within `grace_s` (and every live one)
    took its last step: a discovery read that missed a replica still training must not end the run under it,
    while one that left stops counting `grace_s` after its last word. Until then the trainer feeds the replicas
    that have not finished (one that finished early answers "finished" untrained)."""

    def __init__(self, stop_step: int, grace_s: float = 0.0):
        self.stop_step, self.grace_s = int(stop_step), float(grace_s)
        self.steps: dict[str, int] = {}
        self.heard: dict[str, float] = {}

    def saw(self, peer: str, step: int, now: float = 0.0) -> None:
        self.steps[peer] = max(self.steps.get(peer, 0), int(step))
        self.heard[peer] = max(self.heard.get(peer, now), now)

    def done(self) -> set[str]:
        """The replicas known to have taken their last step."""
        return {peer for peer, step in self.steps.items() if step >= self.stop_step}

    def finished(self, live: Iterable[str], now: float = 0.0) -> bool:
        """Whether every replica in `live` (the stage's current members; at least one) and every one heard of
        within `grace_s` of `now` took its last step."""
        live = set(live)
        if not live:
            return False
        recent = {peer for peer, t in self.heard.items() if now - t <= self.grace_s}
        return all(self.steps.get(peer, 0) >= self.stop_step for peer in live | recent)
