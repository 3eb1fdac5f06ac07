"""The deterministic split of a trainer's samples among replicas stepping on their own counts
(agoractl.algorithms.routing). Pure: in-memory, no network, explicit clock."""

from __future__ import annotations

import pytest

from agoractl.algorithms.routing import Decision, ReplicaRoute

PEERS = ["QmB", "QmA"]  # discovery's order is not the ranking: peer ids sorted are


def test_blocks_go_round_robin_by_sorted_peer_id_as_the_simulator_splits():
    """Replica batch 4, microbatches of 4: replica r's inner step j is samples [(2j + r) 4, (2j + r + 1) 4)."""
    route = ReplicaRoute(block=4, hold_s=30)
    got = [route.decide(s, PEERS, (), (), now=0.0).peer for s in range(0, 32, 4)]
    assert got == ["QmA", "QmB"] * 4
    # Microbatches smaller than the replica batch: a replica's block stays whole.
    assert [route.assigned(s, PEERS) for s in range(8)] == ["QmA"] * 4 + ["QmB"] * 4
    # The same every time: nothing in the rule depends on timing or speed.
    assert [ReplicaRoute(4, 30).decide(s, reversed(PEERS), (), (), 0.0).peer for s in range(0, 32, 4)] == got


def test_an_unusable_replica_gives_way_to_the_balancer():
    route = ReplicaRoute(block=4, hold_s=30)
    assert route.decide(0, PEERS, ["QmA"], (), 0.0).fallback  # banned, finished, or already failed on this request
    assert route.decide(4, PEERS, ["QmA"], (), 0.0).peer == "QmB"  # the other replica's blocks are not affected
    assert route.decide(0, [], (), (), 0.0).fallback  # no replica known: the balancer waits for discovery
    # A replica that left discovery's list drops out of the ranking: the one left takes every block.
    assert {route.decide(s, ["QmB"], (), (), 0.0).peer for s in range(0, 16, 4)} == {"QmB"}


def test_a_replica_in_a_blocking_mix_is_waited_for_then_given_up_after_hold_s():
    route = ReplicaRoute(block=4, hold_s=30)
    route.waiting("QmA", now=100.0)
    assert route.decide(0, PEERS, (), ["QmA"], 100.05) == Decision(wait=True)
    assert route.decide(0, PEERS, (), (), 100.2).peer == "QmA"  # asked again once its skip expires
    route.waiting("QmA", now=100.3)  # still in the mix: held since 100.0, not 100.3
    assert route.decide(0, PEERS, (), ["QmA"], 129.0).wait
    assert route.decide(0, PEERS, (), ["QmA"], 130.0).fallback  # a mix lasts at most hold_s
    route.served("QmA")  # it trained a request: out of the mix
    route.waiting("QmA", now=200.0)
    assert route.decide(0, PEERS, (), ["QmA"], 200.1).wait


def test_a_replicas_blocks_reach_it_in_the_order_they_were_drawn():
    """Two requests for one replica queued behind its blocking mix: the later block waits for the earlier one,
    or it would make up the earlier inner step."""
    route = ReplicaRoute(block=4, hold_s=30)
    assert route.decide(0, PEERS, (), ["QmA"], 1.0).wait  # block 0 (QmA) waits for the mix
    assert route.decide(8, PEERS, (), (), 1.2).wait  # block 2 (QmA): the mix is over, but block 0 goes first
    assert route.decide(4, PEERS, (), (), 1.2).peer == "QmB"  # another replica's block is not held up
    assert route.decide(0, PEERS, (), (), 1.2).peer == "QmA"
    assert route.decide(8, PEERS, (), (), 1.3).peer == "QmA"
    # A request given up (retries spent) is forgotten: it holds nobody up.
    assert route.decide(16, PEERS, (), ["QmA"], 2.0).wait
    route.forget(16)
    assert route.decide(24, PEERS, (), (), 2.1).peer == "QmA"


def test_block_must_be_positive():
    with pytest.raises(ValueError, match="block"):
        ReplicaRoute(block=0, hold_s=1)
