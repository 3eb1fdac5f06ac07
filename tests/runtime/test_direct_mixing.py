"""The direct mixing transport (agoractl.runtime.direct_mixing) between real libp2p peers on loopback.

Each replica is a :class:`DirectMixing` on a P2P daemon of its own (no DHT: the live replicas are given), all in
this process. Covers: a global mix of two and of three replicas (the exact mean, identical everywhere), local
pairs (each replica with the partner the seeded matching picks, the one left over skipped), a replica that
starts its mix seconds after the others (its values wait in their inboxes / theirs in its), a partner that is
killed (not waited for: partial within seconds, bytes and success agree) or alive but never mixing (the deadline;
failed with nothing received) or gone from the stage's live replicas, non-finite values (dropped), a partner that
skipped the mix declining it at once, the bf16 wire, admission (real credentials: a worker of another stage is
refused both ways), and the stage state served to a joining worker. Under a minute on a loaded 2-core machine.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hivemind.p2p import P2P

from agoractl.algorithms.fgdiloco import partner_of, random_matching
from agoractl.auth import credential, keys
from agoractl.runtime.peer_auth import PeerAuth
from agoractl.runtime.direct_mixing import DEAD_AFTER_S, DirectMixing

SIZE = 5000
NS = "test-run.whole.mix"


class Live:
    """The stage's live replicas as a test sets them."""

    def __init__(self):
        self.ids: list[str] = []

    def __call__(self) -> list[str]:
        return list(self.ids)


def replicas(n: int, deadline_s: float = 20.0, wire_dtype: str = "fp32", gates=None, tokens=None):
    live, out, maddrs = Live(), [], []
    for i in range(n):
        initial = list(maddrs)

        async def connect(initial=initial):
            return await P2P.create(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])

        m = DirectMixing(connect, NS, live, size=SIZE, deadline_s=deadline_s, send_timeout_s=10.0,
                         wire_dtype=wire_dtype, chunk_bytes=4096,
                         gate=gates[i] if gates else None, token=tokens[i] if tokens else lambda: None)
        maddrs += m.visible_maddrs()
        out.append(m)
    live.ids = sorted(m.peer for m in out)
    return live, out


@pytest.fixture
def swarm():
    made = []

    def make(*args, **kwargs):
        live, ms = replicas(*args, **kwargs)
        made.extend(ms)
        return live, ms

    yield make
    for m in made:
        m.shutdown()


def values(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(SIZE, generator=g) for _ in range(n)]


def mix_all(ms, kind, index, vals, delays=None):
    """Start every replica's mix (replica i after delays[i] seconds, each on a thread) and collect the results."""
    out = [None] * len(ms)

    def one(i):
        time.sleep((delays or [0.0] * len(ms))[i])
        out[i] = ms[i].start(kind, index, vals[i]).result(timeout=60)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_global_mix_is_the_exact_mean_everywhere(swarm, n):
    _, ms = swarm(n)
    vals = values(n)
    mean = sum(vals) / n
    results = mix_all(ms, "global", 3, vals)
    payload = SIZE * 4
    for mixed, rec in results:
        assert rec["status"] == "complete" and rec["averaging_success"] == 1.0, rec
        assert rec["group_size"] == n and rec["transport"] == "direct"
        assert rec["bytes_received"] >= (n - 1) * payload and rec["bytes_sent"] >= (n - 1) * payload
        assert rec["duration_s"] < 5
        torch.testing.assert_close(mixed, mean, rtol=0, atol=1e-6)
    assert all(torch.equal(results[0][0], r[0]) for r in results)  # one summation order everywhere


def test_local_mix_pairs_as_the_seeded_matching(swarm):
    _, ms = swarm(3)
    vals = values(3)
    index = 5
    ids = sorted(m.peer for m in ms)
    matching = random_matching(3, __import__("random").Random(index))
    results = mix_all(ms, "local", index, vals)
    for i, (mixed, rec) in enumerate(results):
        other = partner_of(matching, ids.index(ms[i].peer))
        if other is None:
            assert rec["status"] == "skipped" and torch.equal(mixed, vals[i])
        else:
            j = next(k for k, m in enumerate(ms) if m.peer == ids[other])
            assert rec["status"] == "complete" and rec["group_size"] == 2, rec
            torch.testing.assert_close(mixed, (vals[i] + vals[j]) / 2, rtol=0, atol=1e-6)


def test_a_replica_starting_late_still_mixes(swarm):
    _, ms = swarm(3)
    vals = values(3)
    results = mix_all(ms, "global", 7, vals, delays=[0.0, 0.0, 2.0])
    for mixed, rec in results:
        assert rec["status"] == "complete", rec
        torch.testing.assert_close(mixed, sum(vals) / 3, rtol=0, atol=1e-6)
    # Then the next mix, the late one now first: early pushes wait in the others' inboxes.
    results = mix_all(ms, "global", 8, [r[0] for r in results], delays=[1.5, 1.5, 0.0])
    assert [r[1]["status"] for r in results] == ["complete"] * 3


def test_a_killed_partner_is_not_waited_for(swarm):
    _, ms = swarm(3, deadline_s=30.0)
    vals = values(3)
    ms[2].shutdown()  # its daemon is gone; it stays in the live list (its DHT record has not expired yet)
    t0 = time.monotonic()
    results = mix_all(ms[:2], "global", 1, vals)
    assert time.monotonic() - t0 < DEAD_AFTER_S + 6
    for i, (mixed, rec) in enumerate(results):
        assert rec["status"] == "partial" and rec["averaging_success"] == 0.5, rec
        assert rec["bytes_received"] == SIZE * 4 and "push failed" in rec["error"]
        torch.testing.assert_close(mixed, (vals[0] + vals[1]) / 2, rtol=0, atol=1e-6)


def test_a_partner_that_never_mixes_fails_the_mix_at_the_deadline(swarm):
    live, ms = swarm(2, deadline_s=3.0)
    vals = values(2)
    t0 = time.monotonic()
    mixed, rec = ms[0].start("global", 4, vals[0]).result(timeout=30)
    assert 2.5 < time.monotonic() - t0 < 8
    assert rec["status"] == "failed" and rec["averaging_success"] == 0.0 and rec["bytes_received"] == 0, rec
    assert rec["bytes_sent"] == SIZE * 4  # its push was stored by the partner, which never mixed
    assert torch.equal(mixed, vals[0])
    # The partner moves past index 4 without mixing it: the stored push is dropped, and a push of 4 is stale now.
    _, rec1 = ms[1].start("none", 5, vals[1]).result()
    assert rec1["status"] == "skipped"
    _, late = ms[0].start("global", 4, vals[0]).result(timeout=30)
    assert late["status"] == "failed" and late["duration_s"] < 2 and "stale" in late["error"], late


def test_a_partner_that_skips_the_mix_declines_it(swarm):
    _, ms = swarm(2, deadline_s=30.0)
    vals = values(2)
    handle = ms[0].start("global", 6, vals[0])
    time.sleep(1.0)  # its push waits in the partner's inbox
    ms[1].start("none", 7, vals[1])  # the partner goes past 6 (it joined mid-round): it tells the sender
    mixed, rec = handle.result(timeout=30)
    assert rec["status"] == "failed" and rec["duration_s"] < 5 and "declined" in rec["error"], rec


def test_a_partner_that_left_the_stage_is_not_waited_for(swarm):
    live, ms = swarm(2, deadline_s=30.0)
    vals = values(2)
    handle = ms[0].start("global", 3, vals[0])
    time.sleep(0.5)
    live.ids = [ms[0].peer]  # its DHT record expired: it is no longer among the stage's replicas
    mixed, rec = handle.result(timeout=30)
    assert rec["status"] == "failed" and rec["duration_s"] < 5 and "left the stage" in rec["error"], rec
    assert rec["bytes_received"] == 0 and torch.equal(mixed, vals[0])


def test_non_finite_values_are_dropped(swarm):
    _, ms = swarm(2)
    vals = values(2)
    bad = vals[1].clone()
    bad[7] = float("nan")
    (mixed, rec), (_, rec1) = mix_all(ms, "global", 2, [vals[0], bad])
    assert rec["status"] == "failed" and rec["dropped_parts"] == 1 and rec["bytes_received"] == 0, rec
    assert torch.equal(mixed, vals[0]) and rec1["status"] == "complete"


def test_bf16_wire(swarm):
    _, ms = swarm(2, wire_dtype="bf16")
    vals = values(2)
    results = mix_all(ms, "global", 2, vals)
    expected = sum(v.bfloat16().float() for v in vals) / 2
    for mixed, rec in results:
        assert rec["status"] == "complete" and rec["bytes_received"] >= SIZE * 2
        assert rec["bytes_received"] < SIZE * 3  # two bytes a value
        torch.testing.assert_close(mixed, expected, rtol=0, atol=1e-6)


def test_admission_refuses_a_replica_without_a_valid_credential(swarm):
    """Real credentials (agoractl.auth) checked by PeerAuth.gate_replica: a worker of another stage gets nothing
    and gives nothing; the two admitted replicas mix with each other, counting the refusals."""
    key = keys.generate()
    auth = [PeerAuth("test-run", keys.public_text(key)) for _ in range(3)]
    tokens = [None] * 3
    _, ms = swarm(3, deadline_s=20.0, gates=[a.gate_replica("whole") for a in auth],
                  tokens=[lambda i=i: tokens[i] for i in range(3)])
    for i, (m, stage) in enumerate(zip(ms, ["whole", "whole", "body-1"])):
        tokens[i] = credential.issue(key, run="test-run", node_id=f"n{i}", account="x", role="worker", stage=stage,
                                     peer_id=m.peer, ttl_s=300, serial=1)
    vals = values(3)
    t0 = time.monotonic()
    results = mix_all(ms, "global", 1, vals)
    assert time.monotonic() - t0 < DEAD_AFTER_S + 8
    for mixed, rec in results[:2]:
        assert rec["status"] == "partial" and rec["bytes_received"] == SIZE * 4, rec
        assert "credential refused: wrong_stage" in rec["error"], rec
        torch.testing.assert_close(mixed, (vals[0] + vals[1]) / 2, rtol=0, atol=1e-6)
    assert results[2][1]["status"] == "failed" and results[2][1]["bytes_received"] == 0, results[2][1]
    assert torch.equal(results[2][0], vals[2])
    assert all(a.stats()["refused"].get("direct_mixing:wrong_stage", 0) >= 1 for a in auth[:2]), auth[0].stats()


def test_stage_state_served_to_a_joining_worker(swarm):
    _, ms = swarm(2)
    state = ({"stage": "whole", "step": 12, "names": ["w"]}, [torch.arange(20000, dtype=torch.float32), torch.ones(3)])
    ms[0].state_provider = lambda: state
    ms[1].state_sources = lambda: [ms[0].peer]
    meta, tensors = ms[1].load_stage_state(timeout=20)
    assert meta["step"] == 12 and meta["ready"] and meta["names"] == ["w"]
    assert len(tensors) == 2 and torch.equal(tensors[0], state[1][0]) and torch.equal(tensors[1], state[1][1])
