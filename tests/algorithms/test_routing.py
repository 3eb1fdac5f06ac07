"""The deterministic split of a trainer's samples among replicas stepping on their own counts
(agoractl.algorithms.routing). Pure: in-memory, no network, explicit clock."""

from __future__ import annotations

import pytest

from agoractl.algorithms.routing import Decision, ReplicaRoute

PEERS = ["QmB", "QmA"]  # discovery's order is not the ranking: peer ids sorted are


def decide(route: ReplicaRoute, sample: int, unusable=(), held=(), now: float = 0.0, peers=PEERS) -> Decision:
    """A request of one block (microbatch = replica batch = 4), as the shipped manifest sends them."""
    return route.decide(sample, peers, unusable, held, now, size=4)


def test_blocks_go_round_robin_by_sorted_peer_id_as_the_simulator_splits():
    """Replica batch 4, microbatches of 4: replica r's inner step j is samples [(2j + r) 4, (2j + r + 1) 4)."""
    route = ReplicaRoute(block=4, hold_s=30)
    got = [decide(route, s).peer for s in range(0, 32, 4)]
    assert got == ["QmA", "QmB"] * 4
    # The same every time: nothing in the rule depends on timing or speed.
    again = ReplicaRoute(block=4, hold_s=30)
    assert [decide(again, s, peers=list(reversed(PEERS))).peer for s in range(0, 32, 4)] == got
    # Microbatches smaller than the replica batch: a replica's block stays whole.
    assert [route.assigned(s, PEERS) for s in range(8)] == ["QmA"] * 4 + ["QmB"] * 4
    small = ReplicaRoute(block=4, hold_s=30)
    assert [small.decide(s, PEERS, (), (), 0.0, size=2).peer for s in range(0, 16, 2)] == \
        ["QmA", "QmA", "QmB", "QmB"] * 2


def test_an_unusable_replica_gives_way_to_the_balancer():
    route = ReplicaRoute(block=4, hold_s=30)
    assert decide(route, 0, unusable=["QmA"]).fallback  # banned, finished, or already failed on this request
    assert decide(route, 4, unusable=["QmA"]).peer == "QmB"  # the other replica's blocks are not affected
    assert decide(route, 8, peers=[]).fallback  # no replica known: the balancer waits for discovery
    # A replica that left discovery's list drops out of the ranking: the one left takes every block.
    assert {decide(route, s, peers=["QmB"]).peer for s in range(12, 28, 4)} == {"QmB"}


def test_a_replica_in_a_blocking_mix_is_waited_for_then_given_up_after_hold_s():
    route = ReplicaRoute(block=4, hold_s=30)
    route.waiting("QmA", now=100.0)
    assert decide(route, 0, held=["QmA"], now=100.05) == Decision(wait=True)
    assert decide(route, 0, now=100.2).peer == "QmA"  # asked again once its skip expires
    route.waiting("QmA", now=100.3)  # still in the mix: held since 100.0, not 100.3
    assert decide(route, 0, held=["QmA"], now=129.0).wait
    assert decide(route, 0, held=["QmA"], now=130.0).fallback  # a mix lasts at most hold_s
    route.served("QmA")  # it trained a request: out of the mix
    route.waiting("QmA", now=200.0)
    assert decide(route, 8, held=["QmA"], now=200.1).wait


def test_a_replicas_blocks_reach_it_in_the_order_they_were_drawn():
    """A later block of a replica waits until its earlier ones are on their way: drawn by concurrent pipelines,
    or queued behind its blocking mix, they would otherwise race for it, and make up each other's inner steps."""
    route = ReplicaRoute(block=4, hold_s=30)
    assert decide(route, 8).wait  # block 2 (QmA) drawn, block 0 (QmA) drawn before it and not yet sent
    assert decide(route, 4).peer == "QmB"  # another replica's block is not held up
    assert decide(route, 0).peer == "QmA" and decide(route, 8).peer == "QmA"
    # Queued behind the replica's mix: block 4 answered "waiting", block 6 waits for it even once the mix ends.
    assert decide(route, 12).peer == "QmB"
    assert decide(route, 16).peer == "QmA"  # sent; it answers "waiting": asked again
    assert decide(route, 16, held=["QmA"]).wait
    assert decide(route, 20).peer == "QmB"
    assert decide(route, 24, held=["QmA"]).wait and decide(route, 24).wait
    assert decide(route, 16).peer == "QmA" and decide(route, 24).peer == "QmA"
    # A request given up (retries spent) is forgotten: it holds nobody up.
    assert decide(route, 28).peer == "QmB"
    assert decide(route, 32, held=["QmA"]).wait
    route.forget(32, 4)
    assert decide(route, 36).peer == "QmB" and decide(route, 40).peer == "QmA"


def test_block_must_be_positive():
    with pytest.raises(ValueError, match="block"):
        ReplicaRoute(block=0, hold_s=1)
