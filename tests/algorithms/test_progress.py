"""Stage progress (agoractl.algorithms.progress): when replicas step, collectively or each on its own count
(FGDiLoCo with data_parallel.fgdiloco.replicas), and when a trainer sees such a stage finished. Pure, in-memory."""

from __future__ import annotations

from agoractl.algorithms.progress import (PeerProgress, ReplicaSteps, StageProgress, checkpoint_publisher,
                                         run_position)


def test_a_lone_replica_steps_every_global_batch_exactly():
    p = StageProgress(target=8, max_steps=3)
    p.add(5)
    assert p.room() == 3 and not p.should_step()
    p.add(3)
    assert p.should_step() and p.room() == 0
    assert p.advance() == 8 and p.step == 1 and p.room() == 8
    for _ in range(2):
        p.add(8)
        p.advance()
    p.add(8)
    assert p.finished and not p.should_step()  # never past max_steps


def test_replicas_count_together():
    a, b = StageProgress(8, 10), StageProgress(8, 10)
    a.add(5)
    b.add(3)
    a.observe({"b": PeerProgress(b.step, b.total)})
    b.observe({"a": PeerProgress(a.step, a.total)})
    assert a.collective() == b.collective() == 8
    assert a.should_step() and b.should_step()
    assert a.advance() == 5 and b.advance() == 3  # each applies its own share of the batch


def test_a_replicas_share_is_of_the_samples_its_live_replicas_ran():
    """The share the forward hold scales the stage's missing samples by (Worker._forwards_wait)."""
    a = StageProgress(8, 10)
    assert a.own_share() == 1.0  # alone
    a.observe({"b": PeerProgress(0, 6)})
    assert a.own_share() == 1.0  # a newcomer that ran nothing yet: as if alone
    a.add(2)
    assert a.own_share() == 0.25
    a.observe({"b": PeerProgress(0, 6), "c": PeerProgress(0, 0)})
    assert a.own_share() == 0.25  # a live replica that ran nothing holds no share
    a.observe({"c": PeerProgress(0, 2)})  # b left: its samples still count toward the stage, not toward the share
    assert a.stage_total() == 10 and a.own_share() == 0.5
    a.add(2, report=False)  # a sync phase's samples are not reported, nor counted in the share
    assert a.own_share() == 0.5


def test_samples_seen_late_count_toward_the_next_step_not_the_current_one():
    """A stale view makes a replica overshoot the batch; the excess is credited to the next step, so
    over many steps the stage applies one global batch per step."""
    a, b = StageProgress(8, 100), StageProgress(8, 100)
    for _ in range(50):
        for _ in range(6):  # a and b each serve 6 samples per round, seeing each other a round late
            a.add(1)
            b.add(1)
            if a.should_step():
                a.advance()
            if b.should_step():
                b.advance()
        a.observe({"b": PeerProgress(b.step, b.total)})
        b.observe({"a": PeerProgress(a.step, a.total)})
    total = a.total + b.total
    assert abs(a.step - total / 8) <= 1 and abs(b.step - a.step) <= 1


def test_a_pushed_count_moves_the_view_forward_between_dht_reads():
    """Pushes (agoractl.runtime.progress_push) arrive between DHT reads: they only move a peer's count forward,
    and a DHT read older than the last push rolls no count back."""
    a = StageProgress(8, 10)
    a.observe({"b": PeerProgress(0, 2)})
    a.add(3)
    a.heard("b", PeerProgress(0, 5))
    assert a.collective() == 8 and a.should_step()
    a.advance()
    a.heard("b", PeerProgress(1, 6))
    a.heard("b", PeerProgress(0, 4))  # a late push, overtaken by a newer one
    a.observe({"b": PeerProgress(0, 5)})  # the DHT's copy, older than the pushes
    assert a.peer_totals == {"b": 6} and a.collective() == 1
    a.heard("c", PeerProgress(1, 7))  # a replica the DHT has not shown yet
    assert a.collective() == 8 and a.own_share() == 3 / 16


def test_pushes_wait_for_a_joiners_first_view_and_never_count_on_own_counts():
    joiner = StageProgress(8, 10, step=4)
    joiner.heard("b", PeerProgress(step=4, total=16, seen=35))  # before its first DHT view: where it counts from
    assert joiner.collective() == 0 and joiner.peer_totals == {}
    joiner.observe({"b": PeerProgress(step=4, total=16, seen=35)})
    joiner.heard("b", PeerProgress(step=4, total=18, seen=37))
    assert joiner.collective() == 5
    own = StageProgress(8, 10, own=True)
    own.heard("b", PeerProgress(step=3, total=30))
    assert own.peer_totals == {} and not own.ahead()


def test_a_replica_behind_follows_the_one_ahead():
    a = StageProgress(8, 10)
    a.add(2)
    a.observe({"b": PeerProgress(step=1, total=9)})
    assert a.ahead() and a.should_step()
    a.advance()
    assert not a.should_step()  # a at step 1 with 11 samples seen: step 1 needs 16


def test_a_departed_peer_keeps_its_count():
    a = StageProgress(8, 10)
    a.observe({"b": PeerProgress(0, 6)})
    a.observe({})  # b's record expired: its samples still happened
    assert a.collective() == 6 and a.peers == {}
    a.add(2)
    assert a.should_step()


def test_a_joiner_starts_at_the_stage_step_and_counts_from_there():
    joiner = StageProgress(8, 10, step=4)
    assert joiner.collective() == 0 and joiner.room() == 8
    joiner.observe({"old": PeerProgress(step=4, total=35)})  # 32 for steps 0-3, 3 toward step 4
    assert joiner.collective() == 3
    joiner.add(5)
    assert joiner.should_step() and joiner.stage_step() == 4


def test_a_joiner_counts_the_samples_of_replicas_that_left_before_it_came():
    # "a" ran 19 samples and left; "b" ran 16 and saw the stage at 35 (32 for steps 0-3, 3 toward step 4)
    joiner = StageProgress(8, 10, step=4)
    joiner.observe({"b": PeerProgress(step=4, total=16, seen=35)})
    assert joiner.collective() == 3 and joiner.room() == 5
    joiner.add(2)
    joiner.observe({"b": PeerProgress(step=4, total=19, seen=37)})
    assert joiner.should_step() and joiner.collective() == 8
    stale = StageProgress(8, 10, step=4)
    stale.observe({"b": PeerProgress(step=4, total=16)})  # a peer that does not say what it saw: from the step
    assert stale.collective() == 0 and stale.room() == 8


def test_a_stage_restarted_at_a_step_takes_one_batch_per_step_from_there():
    """A run resumed from its step-4 checkpoint: the lone replica's first step takes one global batch, not
    the 40 samples of steps 0-4 (a joiner, by contrast, learns what came before from its peers' counts)."""
    resumed = StageProgress(8, 10, step=4, restarts=True)
    resumed.add(7)
    assert resumed.room() == 1 and not resumed.should_step()
    resumed.add(1)
    assert resumed.should_step() and resumed.advance() == 8 and resumed.step == 5
    resumed.add(8)
    assert resumed.should_step()
    joiner = StageProgress(8, 10, step=4)
    joiner.add(8)
    assert not joiner.should_step()  # no peer counts: it waits for a replica ahead


def test_a_stage_rejoining_at_the_runs_count_steps_with_the_other_stages():
    """The only tail worker died mid-step: the head had counted 3 samples of step 4 (of 8). Its replacement
    starts at the head's count, so its step 4 ends after the same 5 samples as the head's, not 8 later."""
    head = StageProgress(8, 10, step=4, restarts=True)
    head.add(3)
    tail = StageProgress(8, 10, step=4, seen=head.stage_total())
    assert tail.room() == 5
    for p in (head, tail):
        p.add(5)
        assert p.should_step() and p.advance() and p.step == 5


def test_run_position_is_the_furthest_other_stage_and_none_before_training():
    assert run_position([]) is None
    assert run_position([PeerProgress(0, 0, 0), PeerProgress(0, 0)]) is None  # the run is starting
    pos = run_position([PeerProgress(6, 20, 51), PeerProgress(5, 30, 47), PeerProgress(6, 0)])
    assert pos == PeerProgress(6, 30, 51)


def test_the_publisher_is_the_smallest_peer_id_among_replicas_that_trained():
    assert checkpoint_publisher({"b": 500, "c": 460}) == "b"
    assert checkpoint_publisher({"a": 3, "b": 500, "c": 460}) == "b"  # a banned replica ran next to nothing
    assert checkpoint_publisher({"a": 50, "b": 500}) == "a"  # a tenth of the most is a fair share
    assert checkpoint_publisher({"a": 0, "b": 0}) == "a"  # nothing ran yet: the smallest id, as before
    assert checkpoint_publisher({}) is None
    assert checkpoint_publisher({"a": 0, "b": 10}, share=0.0) == "a"


def test_every_replica_names_the_same_publisher_from_its_own_progress():
    """Each replica's view: its own total, and the peers' published ones (a departed peer is not a candidate)."""
    views = {}
    for me, mine, others in (("a", 3, {"b": PeerProgress(4, 500), "c": PeerProgress(4, 460)}),
                             ("b", 500, {"a": PeerProgress(4, 3), "c": PeerProgress(4, 460)}),
                             ("c", 460, {"a": PeerProgress(4, 3), "b": PeerProgress(4, 500)})):
        p = StageProgress(target=8, max_steps=100)
        p.observe({**others, "gone": PeerProgress(2, 900)})
        p.observe(others)  # "gone" left: its count stays in the stage's total, not among the candidates
        p.add(mine)
        assert p.contributions(me) == {**{k: v.total for k, v in others.items()}, me: mine}
        views[me] = checkpoint_publisher(p.contributions(me))
    assert views == {"a": "b", "b": "b", "c": "b"}


def test_replicas_on_their_own_counts_each_step_on_exactly_their_batch():
    """M = 2, global batch 8: each replica steps on its own 4 samples, whatever its peer did or how far it got,
    so every step's global batch is exactly 8 (seed 002's inner steps)."""
    a, b = StageProgress(4, 10, own=True), StageProgress(4, 10, own=True)
    a.add(3)
    a.observe({"b": PeerProgress(step=2, total=9)})  # b is ahead and has run more: neither moves a
    assert a.collective() == 3 and a.room() == 1 and not a.ahead() and not a.should_step()
    a.add(1)
    assert a.should_step() and a.advance() == 4 and a.room() == 4
    b.add(6)  # more than its batch queued at once: the excess counts toward its next step
    assert b.should_step() and b.advance() == 6 and b.collective() == 2
    assert a.contributions("a") == {"b": 9, "a": 4}  # the checkpoint publisher still reads every count


def test_a_replica_on_its_own_count_joining_or_resuming_at_a_step_takes_one_batch_for_it():
    for p in (StageProgress(4, 10, step=6, own=True), StageProgress(4, 10, step=6, restarts=True, own=True),
              StageProgress(4, 10, step=6, seen=100, own=True)):
        p.observe({"old": PeerProgress(step=6, total=30)})
        assert p.room() == 4
        p.add(4)
        assert p.should_step() and p.advance() == 4 and p.step == 7


def test_a_stage_on_own_counts_is_finished_when_every_live_replica_took_its_last_step():
    seen = ReplicaSteps(stop_step=40, grace_s=10)
    assert not seen.finished([])  # nobody discovered yet
    seen.saw("a", 40, now=100)
    seen.saw("b", 38, now=100)
    seen.saw("b", 12, now=101)  # an old record: steps only go forward
    assert seen.done() == {"a"} and not seen.finished(["a", "b"], now=102)
    assert not seen.finished(["a"], now=105)  # a read that missed b, heard of 5 s ago: b still trains
    assert seen.finished(["a"], now=112)  # b left the stage: silent past the grace, it no longer counts
    seen.saw("b", 40, now=113)
    assert seen.finished(["a", "b"], now=113) and seen.done() == {"a", "b"}
    assert not seen.finished(["a", "b", "c"], now=113)  # a newcomer not heard from yet
