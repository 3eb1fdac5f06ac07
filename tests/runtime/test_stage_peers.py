"""The stage's live replicas as a worker counts them (agoractl.runtime.stage_peers), on DHT reads
given directly (a dict of records, what ``RunRecords.stage_workers`` returns): in-memory, no network."""

from __future__ import annotations

from types import SimpleNamespace

from agoractl.runtime.stage_peers import StagePeers


class Reads:
    """Successive answers of ``stage_workers``: peer -> record with a role."""

    def __init__(self, *answers):
        self.answers = list(answers)

    def stage_workers(self, stage):
        return self.answers.pop(0)


def rec(role="operator"):
    return SimpleNamespace(role=role)


def test_live_count_remembers_a_record_missing_from_one_read():
    peers = StagePeers(Reads({"a": rec(), "b": rec()}, {"a": rec()}), "head", "a", announce_period_s=1.0)
    peers.read()
    assert peers.live == 2 and peers.others_now == 1
    peers.read()  # b missing from this read only: still counted within a record's lifetime
    assert peers.live == 2 and peers.others_now == 0


def test_first_operator_is_the_lowest_operator_peer_id_contributors_aside():
    reads = Reads({"b": rec(), "c": rec(), "a": rec("contributor")})
    b = StagePeers(reads, "head", "b", announce_period_s=1.0)
    b.read()
    assert b.first_operator()
    c = StagePeers(Reads({"b": rec(), "c": rec()}), "head", "c", announce_period_s=1.0)
    c.read()
    assert not c.first_operator()
    alone = StagePeers(Reads({}), "head", "z", announce_period_s=1.0)
    alone.read()  # its own record not yet propagated: it still counts itself
    assert alone.live == 1 and alone.first_operator()


def test_live_now_reads_afresh_only_when_the_view_is_alone():
    # A round due before the watcher's first read of a peer asks the DHT itself instead of skipping its mix.
    reads = Reads({"a": rec()}, {"a": rec(), "b": rec()})
    peers = StagePeers(reads, "whole", "a", announce_period_s=1.0)
    peers.read()
    assert peers.live == 1
    assert peers.live_now() == 2 and not reads.answers
    assert peers.live_now() == 2  # not alone: no read (Reads would raise on an empty list)
    failing = StagePeers(Reads(), "whole", "a", announce_period_s=1.0)
    assert failing.live_now() == 1  # a failed read keeps the last view


def test_alone_once_no_serving_replica_was_read_for_a_records_lifetime(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("agoractl.runtime.stage_peers.time.monotonic", lambda: now[0])
    syncing, serving = SimpleNamespace(role="contributor", phase="weight_sync"), SimpleNamespace(role="operator",
                                                                                                  phase="active")
    peers = StagePeers(Reads({"a": serving, "j": syncing}, {"j": syncing}, {"j": syncing}, {"j": syncing}),
                       "head", "j", announce_period_s=1.0)
    assert peers.alone_for_s() == 0.0 and not peers.alone()  # no read yet: nothing known
    peers.read()
    assert peers.serving_others_now == 1 and not peers.alone()
    now[0] += 3.0
    peers.read()  # a's record gone (killed): missing from one read is not a departure
    assert peers.serving_others_now == 0 and peers.alone_for_s() == 3.0 and not peers.alone()
    now[0] += 2.0
    peers.read()
    assert peers.alone()  # 5 s, a record's lifetime, without a serving replica
    lonely = StagePeers(Reads({"j": syncing}, {"j": syncing}), "head", "j", announce_period_s=1.0)
    lonely.read()
    assert not lonely.alone()  # never saw a serving replica: counted from its first read
    now[0] += 5.0
    lonely.read()
    assert lonely.alone()


def test_the_rounds_serving_replicas_announce_are_remembered():
    def serving(r):
        return SimpleNamespace(role="operator", phase="active", round=r)

    syncing = SimpleNamespace(role="contributor", phase="weight_sync", round=3)
    peers = StagePeers(Reads({"a": serving(3), "b": serving(None), "j": syncing, "me": serving(3)},
                             {"a": serving(4), "b": serving(4)}), "head", "me", announce_period_s=1.0)
    peers.read()
    assert peers.rounds_now == {"a": 3}  # not itself, not a replica between rounds, not one in weight sync
    peers.read()
    assert peers.rounds_now == {"a": 4, "b": 4}
    assert peers.seen_in_round(3) == {"a"} and peers.seen_in_round(4) == {"a", "b"} and peers.seen_in_round(5) == set()
