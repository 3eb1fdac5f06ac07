"""SPARTA's round logic in the worker (agoractl.training.sparta_rounds), in one process, no network.

Real :class:`Worker` replicas of one stage and the real :class:`SpartaRounds` (tiling, weights, sync
phases, delta rule); only the averaging transport is a fake, :class:`InMemoryStage`: a round's group
forms once every replica still in the stage began it, each member reduces one slice of the values
(hivemind's butterfly), a reducer preempted during ``reduce`` never returns its slice. Covers: a round
waits for the previous one, answering requests meanwhile; a round without a group is no failure while the
others average other rounds, and a round the others moved past is skipped; a replica one step behind
still joins (one a whole round behind begins the stage's current round); a lone survivor skips; a preempted
peer's round is partial and the next one whole; a joiner's weight-sync and optimizer-sync rounds carry
weight 0. The same logic over hivemind, in a real swarm: tests/runtime/test_sparta_swarm.py.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from agoractl.algorithms.progress import PeerProgress
from agoractl.algorithms.sparta import weighted_average
from agoractl.manifest.loader import load_manifest
from agoractl.training.data_parallel import RoundRecord
from agoractl.training.sparta_rounds import SpartaRounds
from agoractl.training.worker import Task, Worker
from tests.conftest import MANIFESTS

EVERY = 2
SAMPLES = 2  # per replica and step


class InMemoryStage:
    """The averaging transport between in-process replicas of a stage (a fake of the transport only)."""

    def __init__(self, deadline_s: float = 30.0):
        self.deadline_s = deadline_s
        self.cond = threading.Condition()
        self.members: set[str] = set()
        self.joined: dict[int, dict[str, tuple]] = {}  # round -> member -> (values, weight, fault)
        self.results: dict[int, dict[str, tuple]] = {}  # round -> member -> (average, averaged, record)
        self.began: dict[str, list[tuple]] = {}  # member -> [(round, weight, fault)]

    def member(self, name: str) -> "Member":
        self.members.add(name)
        self.began[name] = []
        return Member(self, name)

    def leave(self, name: str) -> None:
        with self.cond:
            self.members.discard(name)
            for r in list(self.joined):
                self._maybe_form(r)
            self.cond.notify_all()

    def begin(self, name: str, round_index: int, segment: int, values: torch.Tensor, weight: float,
              fault) -> None:
        with self.cond:
            self.began[name].append((round_index, weight, fault))
            self.joined.setdefault(round_index, {})[name] = (values.clone(), float(weight), fault)
            self._maybe_form(round_index)
            self.cond.notify_all()

    def expire(self, r: int) -> None:
        """Round `r`'s matchmaking window ends: its group is whoever began it (alone: no group)."""
        with self.cond:
            self._maybe_form(r, whoever=True)
            self.cond.notify_all()

    def _maybe_form(self, r: int, whoever: bool = False) -> None:
        joined = self.joined.get(r, {})
        if r in self.results or not joined or not (whoever or self.members <= set(joined)):
            return
        group = sorted(joined)
        slices = torch.tensor_split(torch.arange(next(iter(joined.values()))[0].numel()), len(group))
        failed = {m for m in group if joined[m][2] == "reduce"}  # their slice never comes back
        senders = [m for m in group if joined[m][2] != "send"]
        total = sum(joined[m][1] for m in senders)
        out = {}
        for m in group:
            values, weight, fault = joined[m]
            rec = RoundRecord(r, -1, "failed", group_size=len(group), reducers=len(group), weight=weight,
                              group_weight=total, snapshot_sum=float(values.double().sum()), grouped=len(group) >= 2)
            if fault is not None:
                rec.error = f"preempted during {fault}"
                out[m] = (None, None, rec)
                continue
            if len(group) < 2:
                rec.group_size, rec.error = 0, "no group formed"
                out[m] = (None, None, rec)
                continue
            average = weighted_average([joined[s][0] for s in senders], [joined[s][1] for s in senders])
            if average is None:
                rec.status = "empty"
                out[m] = (None, None, rec)
                continue
            averaged = torch.ones(values.numel(), dtype=torch.bool)
            for reducer, idx in zip(group, slices):
                if reducer in failed:
                    averaged[idx] = False
            rec.averaging_success = float(averaged.float().mean())
            rec.status = "complete" if rec.averaging_success == 1.0 else "partial"
            rec.average_sum = float(average[averaged].double().sum())
            out[m] = (average, averaged, rec)
        self.results[r] = out
        for m in failed | {m for m in group if joined[m][2] == "send"}:
            self.members.discard(m)  # preempted: the worker is gone


class Member:
    def __init__(self, stage: InMemoryStage, name: str):
        self.stage, self.name = stage, name
        self.round_deadline_s = stage.deadline_s

    def begin_round(self, round_index, segment, values, weight, expected_peers, fault=None):
        self.stage.begin(self.name, round_index, segment, values, weight, fault)
        return Pending(self.stage, self.name, round_index, segment)

    def shutdown(self):
        self.stage.leave(self.name)


class Pending:
    def __init__(self, stage: InMemoryStage, name: str, round_index: int, segment: int):
        self.stage, self.name, self.round, self.segment = stage, name, round_index, segment
        self.cancelled = False

    def done(self) -> bool:
        with self.stage.cond:
            return self.cancelled or self.round in self.stage.results

    def looking(self) -> bool:
        return not self.done()

    def result(self, timeout=None):
        if self.cancelled:
            return None, None, RoundRecord(self.round, self.segment, "failed", error="CancelledError")
        with self.stage.cond:
            assert self.stage.cond.wait_for(self.done, timeout=timeout or 30), f"round {self.round} never formed"
            average, averaged, rec = self.stage.results[self.round][self.name]
        rec.segment = self.segment
        return average, averaged, rec

    def cancel(self):
        self.cancelled = True


def run_of(*values):
    return load_manifest(MANIFESTS / "local-cpu.yaml", [
        "model.seq_len=16", "training.global_batch_size=4", "trainers.microbatch=1", "training.max_steps=1000",
        "data_parallel.method=sparta", "data_parallel.sparta.fraction=0.25",
        f"data_parallel.sparta.every_steps={EVERY}", "checkpoints.snapshots_every_steps=0",
        "checkpoints.every_steps=0", *values])


class Replica:
    """A worker of stage 0 with its rounds, its view of the stage, and a log of its master weights
    taken at every step before the rounds see it."""

    def __init__(self, run, stage: InMemoryStage, name: str, live: int, seed: int):
        self.name = name
        self.worker = Worker(run, 0)
        # the partners "seen" in a round: the other members that began it (the watcher reads their records)
        self.view = SimpleNamespace(live=live, serving_others_now=live - 1, rounds_now={},
                                    seen_in_round=lambda r: set(stage.joined.get(r, {})) - {name})
        self.before: dict[int, dict[str, torch.Tensor]] = {}  # stage step done -> master weights
        self.worker.step_callbacks.append(lambda step, w: self.before.__setitem__(step + 1, self.weights()))
        self.transport = stage.member(name)
        self.rounds = SpartaRounds(run, self.worker, self.transport, self.view, peer=name)
        self.gen = torch.Generator().manual_seed(seed)  # replicas see different data

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in self.rounds.master.items()}

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            for p in self.worker.params:
                p.grad = torch.randn(p.shape, generator=self.gen) * 0.1
            self.worker.progress.add(SAMPLES)
            self.worker.step()

    def records(self, status=None) -> list[dict]:
        return [r for r in self.rounds.rounds if status is None or r["status"] == status]


def replicas(run, n: int, stage: InMemoryStage = None) -> list[Replica]:
    stage = stage or InMemoryStage()
    return [Replica(run, stage, "ABCDE"[m], n, seed=100 + m) for m in range(n)]


def lockstep(reps: list[Replica], steps: int) -> None:
    for _ in range(steps):
        for r in reps:
            r.step()


def test_a_round_waits_for_the_previous_one():
    run = run_of()
    a, b = replicas(run, 2)
    # A trains alone to the step where round 1 is due; round 0 is still forming (B has not begun it).
    t = threading.Thread(target=a.step, args=(2 * EVERY,))
    t.start()
    deadline = time.monotonic() + 60
    while a.worker.progress.step < 2 * EVERY and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert t.is_alive() and [x["round"] for x in a.records()] == []  # A is waiting, round 1 not begun
    # ... and answers requests meanwhile, without stepping (a trainer must not time out on it)
    answered = threading.Event()
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    a.worker.submit(Task("forward", ids, None, None, lambda result, error: error or answered.set()))
    assert answered.wait(10) and t.is_alive() and a.worker.progress.step == 2 * EVERY
    lockstep([b], 2 * EVERY)  # B begins round 0: it forms, A applies it, then begins round 1
    t.join(30)
    assert not t.is_alive()
    lockstep([a, b], 1)  # both collect round 1
    rounds = [(x["round"], x["status"]) for x in a.records()]
    assert rounds == [(0, "complete"), (1, "complete")], rounds
    assert a.records()[0]["applied_at"] == 2 * EVERY  # applied before round 1 began, not skipped
    assert a.records()[1]["waited_s"] >= 0.2
    assert [x[0] for x in a.transport.stage.began["A"]] == [0, 1]


def test_a_round_stops_waiting_for_the_previous_one_once_no_other_replica_serves():
    run = run_of()
    a, b = replicas(run, 2)
    t = threading.Thread(target=a.step, args=(2 * EVERY,))
    t.start()  # A begins round 0; B, its partner, is killed before it joins: A waits for round 0 at round 1
    deadline = time.monotonic() + 60
    while not (a.worker.progress.step >= 2 * EVERY and t.is_alive()) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert t.is_alive() and a.records() == []
    a.view.serving_others_now = 0  # the watcher no longer reads a serving replica: A must serve requests again
    t.join(5)
    assert not t.is_alive()
    assert [(x["round"], x["status"], x["error"]) for x in a.records()] == [
        (1, "skipped", "the previous round still runs and no other replica serves")]
    b.transport.shutdown()  # round 0 ends without a group: nobody served, so not A's failure either
    a.view.live = 1
    a.step(1)
    assert [(x["round"], x["status"]) for x in a.records()] == [(1, "skipped"), (0, "skipped")]


def test_a_round_nobody_comes_to_is_given_up_for_the_one_the_others_are_in():
    run = run_of()
    a, b = replicas(run, 2)
    a.step(EVERY)  # A begins round 0; B never comes: its record says it averages round 1 already
    a.view.rounds_now = {"B": 1}
    t0 = time.monotonic()
    a.step(EVERY)
    assert time.monotonic() - t0 < 5
    assert [(x["round"], x["status"], x["error"]) for x in a.records()] == [
        (0, "skipped", "given up: the other replicas are averaging later rounds")]
    assert [x[0] for x in a.transport.stage.began["A"]] == [0, 1]


def test_a_worker_giving_up_a_window_of_rounds_in_a_row_counts_failures():
    run = run_of()  # self-termination window: 3 rounds
    a, b = replicas(run, 2)
    a.step(EVERY)
    for ahead in (1, 2, 3, 4):  # B is always a round ahead: every round A begins, it gives up at the next one
        a.view.rounds_now = {"B": ahead}
        a.step(EVERY)
    given_up = "given up: the other replicas are averaging later rounds"
    assert [(x["round"], x["status"], x["error"]) for x in a.records()] == [
        (0, "skipped", given_up), (1, "skipped", given_up), (2, "failed", f"{given_up} (3 given up in a row)"),
        (3, "failed", f"{given_up} (4 given up in a row)")]
    # B comes to A's round 4: a round with the others (complete or partial) starts the count again
    segment = 4 % a.rounds.tiling.segments
    b.transport.begin_round(4, segment, b.rounds.tiling.gather(b.rounds.master, segment), 1.0, 2)
    a.view.rounds_now = {"B": 4}
    a.step(1)
    assert (a.records()[-1]["round"], a.records()[-1]["status"]) == (4, "complete")
    assert a.rounds.given_up_in_a_row == 0


def test_a_round_without_a_group_is_no_failure_while_the_others_average_other_rounds():
    run = run_of()
    stage = InMemoryStage()
    a, b = replicas(run, 2, stage)
    a.step(EVERY)  # A begins round 0; B, busy with another round, never comes
    a.view.rounds_now = {"B": 7}
    stage.expire(0)
    a.step(1)
    assert [(x["round"], x["status"], x["error"]) for x in a.records()] == [
        (0, "skipped", "the other replicas were averaging other rounds")]  # not counted toward self-termination
    a.view.rounds_now = {}  # B between rounds (or its short round missed by the records): no evidence
    a.step(EVERY - 1)
    stage.expire(1)
    a.step(1)
    assert [(x["round"], x["status"]) for x in a.records()][1:] == [(1, "failed")]
    a.view.rounds_now = {"B": 9}  # B averages a later round: nobody will come to round 2
    a.step(EVERY - 1)
    assert [(x["round"], x["status"], x["error"]) for x in a.records()][2:] == [
        (2, "skipped", "the other replicas are averaging a later round")]
    assert [x[0] for x in stage.began["A"]] == [0, 1]


def test_a_replica_one_step_behind_still_joins_and_one_a_round_behind_joins_the_stages_round():
    run = run_of()
    a, b = replicas(run, 2)
    lockstep([a, b], EVERY - 1)
    # B learns through the DHT that A is already one step further: it still meets A in round 0.
    b.worker.progress.observe({"A": PeerProgress(step=EVERY + 1, total=0)})
    lockstep([a, b], 2)
    assert [(x["round"], x["status"]) for x in b.records()] == [(0, "complete")]
    assert a.records()[0]["average_sum"] == b.records()[0]["average_sum"]
    # B's counter a whole round behind the stage's (a joiner catching up, a replica that waited for its previous
    # round): the others are in the stage's current round, and B begins that one, not its own
    stage_step = b.worker.progress.step + 2 * EVERY + 1
    b.worker.progress.observe({"A": PeerProgress(step=stage_step, total=0)})
    b.step(EVERY - 1)
    assert [r for r, _, _ in b.transport.stage.began["B"]] == [0, stage_step // EVERY - 1]
    b.worker.progress.observe({"A": PeerProgress(step=b.worker.progress.step, total=0)})
    b.step(2 * EVERY)  # its own count passes the rounds it jumped over: none is begun again
    assert [r for r, _, _ in b.transport.stage.began["B"]] == [0, stage_step // EVERY - 1]


def test_a_lone_survivor_skips():
    run = run_of()
    a, b = replicas(run, 2)
    lockstep([a, b], EVERY + 1)
    assert [x["status"] for x in a.records()] == ["complete"]
    # B leaves while A begins round 1 still counting it: no group forms, and nobody is left to blame.
    a.step(EVERY - 1)
    b.transport.shutdown()
    a.view.live, a.view.serving_others_now = 2, 0
    a.step(1)
    done = a.worker.progress.step
    assert all(torch.equal(t, a.before[done][n]) for n, t in a.weights().items())  # nothing applied
    a.view.live = 1
    a.step(EVERY)  # round 2: A knows it is alone and does not even try
    statuses = [(x["round"], x["status"], x["error"]) for x in a.records()]
    assert statuses[1:] == [(1, "skipped", "no other serving replica of the stage"),
                            (2, "skipped", "no other replica of the stage")], statuses
    assert [x[0] for x in a.transport.stage.began["A"]] == [0, 1]  # round 2 never reached the transport


def test_a_preempted_peers_round_is_partial_and_the_next_one_whole():
    run = run_of()
    reps = replicas(run, 3)
    a, b, c = reps
    signal = SimpleNamespace(id="sig-1", targets=["C"], during="reduce")
    for r in reps:
        r.rounds.signals = [signal]
    lockstep(reps, EVERY)  # round 0 begins; C arms the preemption and dies as a reducer
    assert [x[2] for x in a.transport.stage.began["C"]] == ["reduce"]
    assert [x[2] for x in a.transport.stage.began["A"]] == [None]
    for r in (a, b):
        r.view.live, r.view.serving_others_now = 2, 1
    lockstep([a, b], 1)
    for r in (a, b):
        rec = r.records()[0]
        assert rec["status"] == "partial" and 0 < rec["averaging_success"] < 1, rec
    # What did not come back kept its local value; what came back moved by the delta rule.
    seg = a.rounds.tiling.gather(a.before[EVERY + 1], 0)
    now = a.rounds.tiling.gather(a.weights(), 0)
    average, averaged, _ = a.transport.stage.results[0]["A"]
    snapshot = a.transport.stage.joined[0]["A"][0]
    assert torch.equal(now[~averaged], seg[~averaged])
    assert torch.allclose(now[averaged], (seg + average - snapshot)[averaged], atol=1e-6)
    lockstep([a, b], EVERY)  # round 1, without C
    for r in (a, b):
        rec = r.records()[1]
        assert (rec["round"], rec["status"], rec["averaging_success"], rec["group_size"]) == (1, "complete", 1.0, 2)
    assert [x[2] for x in a.transport.stage.began["A"]] == [None, None]  # the signal was C's alone


def test_a_joiners_weight_sync_and_optimizer_sync_rounds_carry_weight_0():
    run = run_of("join.max_stale_steps=0", "join.weight_sync_steps=3", "join.optimizer_sync_steps=3")
    reps = replicas(run, 3)
    a, b, j = reps
    for r in (a, b):
        r.rounds.enter(0, 0)
    assert j.rounds.enter(stale_steps=20, stage_step=0) == "weight_sync"
    assert j.worker.phase == "weight_sync"
    lockstep(reps, 3 * EVERY + 1)  # rounds 0 (weight sync), 1 (optimizer sync), 2 (active)
    weights = [(x[0], x[1]) for x in a.transport.stage.began["C"]]
    assert weights == [(0, 0.0), (1, 0.0), (2, float(SAMPLES * EVERY))], weights
    assert [p for p, _ in j.rounds.phases.history] == ["weight_sync", "optimizer_sync", "active"]
    assert j.worker.phase == "active"
    assert all(w == SAMPLES * EVERY for _, w, _ in a.transport.stage.began["A"])
    # Weight 0 absorbs the consensus without moving it: round 0's average is A's and B's alone.
    joined = a.transport.stage.joined[0]
    expected = weighted_average([joined["A"][0], joined["B"][0]], [joined["A"][1], joined["B"][1]])
    assert torch.allclose(a.transport.stage.results[0]["C"][0], expected)
    assert [x["status"] for x in j.records()] == ["complete"] * 3


def test_a_survivor_beside_a_joiner_in_weight_sync_skips_and_the_joiner_alone_goes_active():
    run = run_of("join.max_stale_steps=0", "join.weight_sync_steps=3", "join.optimizer_sync_steps=3")
    a, b = replicas(run, 2)
    lockstep([a, b], EVERY + 1)
    # B is killed while A begins round 1 still counting it; the only other record A then reads is a joiner's
    # in weight sync (not serving): the round that formed no group is not A's failure.
    a.step(EVERY - 1)
    b.transport.shutdown()
    a.view.live, a.view.serving_others_now = 2, 0
    a.step(1)
    a.step(1)
    assert [(x["round"], x["status"]) for x in a.records()] == [(0, "complete"), (1, "skipped")]
    # A joiner whose stage has no serving replica left goes active at once, announced like any phase change.
    j = Replica(run, InMemoryStage(), "J", 1, seed=7)
    phases = []
    j.rounds.on_phase = phases.append
    assert j.rounds.enter(stale_steps=20, stage_step=2 * EVERY) == "weight_sync"
    assert j.rounds.alone() == "active" and j.worker.phase == "active" and phases == ["weight_sync", "active"]
    assert j.rounds.alone() is None and [p for p, _ in j.rounds.phases.history] == ["weight_sync", "active"]
