"""The shard ledger's claim protocol (agoractl/data/claims.py, claim_store.py) against the real stores:
a local directory and a loopback S3 API server (moto_server, serial: atomic conditional writes as S3).
Concurrency is real threads, each with its own ledger object (its own owner id), as trainer processes
would have; the clock is injected where leases matter."""

from __future__ import annotations

import threading
import uuid

import pytest

from agoractl.data.claim_store import claim_store
from agoractl.data.claims import ClaimLedger, Exhausted, allow_epochs, ledger_state, release_trainer


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "shards")
    env = request.getfixturevalue("serial_s3_env")
    return env["make_bucket"](f"claims-{uuid.uuid4().hex[:10]}") + "/shards"


def ledger(root, trainer, tokens=(1000,) * 8, epochs=1, clock=None, lease_s=30.0):
    import time

    return ClaimLedger(claim_store(root), list(tokens), seed=0, epochs=epochs, trainer=trainer, lease_s=lease_s,
                       clock=clock or time.time)


def test_fifty_concurrent_claims_never_hand_a_shard_to_two_claimants(root):
    """50 claimants, each its own ledger object (a trainer process), claim one shard each from one barrier,
    40 shards for 50: every shard goes to exactly one claimant (the store's atomic create decides)."""
    n, shards = 50, 40
    barrier = threading.Barrier(n)
    won: dict[int, list] = {}
    errors = []

    def claimant(i):
        led = ledger(root, i, tokens=(1000,) * shards, lease_s=3600)
        try:
            barrier.wait()
            won.setdefault(i, []).extend((c.shard, c.epoch) for c in led.acquire(1))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=claimant, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors, errors
    claimed = [k for v in won.values() for k in v]
    assert sorted(claimed) == [(s, 0) for s in range(shards)], won  # each shard once, none skipped
    state = ledger_state(claim_store(root), shards, 1)
    owners = {c["shard"]: c["trainer"] for c in state["epochs"][0]["claims"]}
    assert all(owners[s] == i for i, v in won.items() for s, _ in v)


def test_epochs_in_order_and_exhaustion(root):
    """Epoch 1 starts only when every shard of epoch 0 is done; its order is a permutation from the seed."""
    a, b = ledger(root, 0, tokens=(100,) * 4, epochs=2), ledger(root, 1, tokens=(100,) * 4, epochs=2)
    got_a = a.acquire(3)
    got_b = b.acquire(3)
    assert [c.shard for c in got_a] == [0, 1, 2] and [c.shard for c in got_b] == [3]  # b starts at 3
    for c in got_a:
        assert a.update(c.shard, 0, 100, [], done=True)
    assert a.acquire(3) == []  # epoch 0's last shard is held by a live trainer: wait
    assert b.update(3, 0, 100, [], done=True)
    got = a.acquire(4)
    assert {c.epoch for c in got} == {1} and sorted(c.shard for c in got) == [0, 1, 2, 3]
    for c in got:
        a.update(c.shard, 1, 100, [], done=True)
    with pytest.raises(Exhausted):
        a.acquire(1)
    assert allow_epochs(claim_store(root), 3) == 3  # an operator's forced wrap
    assert {c.epoch for c in b.acquire(1)} == {2}


def test_expired_lease_is_taken_over_with_its_position_and_the_old_holder_loses_it(root):
    now = [1000.0]
    a = ledger(root, 0, tokens=(500,) * 2, clock=lambda: now[0], lease_s=10)
    b = ledger(root, 1, tokens=(500,) * 2, clock=lambda: now[0], lease_s=10)
    (c,) = a.acquire(1)
    assert a.update(c.shard, 0, 130, [195, 260], done=False)
    (d,) = b.acquire(1)
    assert d.shard != c.shard  # a live lease is respected
    now[0] += 11  # a's lease ran out (b renews its own)
    assert b.update(d.shard, 0, 0, [], done=False) is True
    (t,) = b.acquire(1)
    assert (t.shard, t.consumed, t.skip, t.trainer) == (c.shard, 130, [195, 260], 1)
    assert t.history[0]["trainer"] == 0 and t.history[0]["consumed"] == 130
    assert a.update(c.shard, 0, 195, [260], done=False) is False  # the old holder learns it lost the shard


def test_restarted_trainer_takes_its_own_claims_back_and_operators_release_a_dead_ones(root):
    a = ledger(root, 0, tokens=(500,) * 3)
    (c,) = a.acquire(1)
    a.update(c.shard, 0, 65, [], done=False)
    other = ledger(root, 1, tokens=(500,) * 3)
    (o,) = other.acquire(1)
    again = ledger(root, 0, tokens=(500,) * 3)  # the same ledger index, a new process
    got = again.acquire(2)  # the last unclaimed shard, then its own claim back (not trainer 1's live one)
    assert [(d.shard, d.consumed) for d in got] == [(3 - c.shard - o.shard, 0), (c.shard, 65)]
    assert again.update(c.shard, 0, 130, [], done=False)
    assert sorted(release_trainer(claim_store(root), 0)) == sorted([(c.shard, 0), (3 - c.shard - o.shard, 0)])
    assert (c.shard, 130) in [(x.shard, x.consumed) for x in other.acquire(2)]
