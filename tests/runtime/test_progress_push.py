"""Progress pushed between the replicas of a stage (agoractl.runtime.progress_push), between real libp2p peers.

Each replica is a :class:`ProgressPush` on a P2P daemon of its own, served on an asyncio loop of its own thread,
all in this process (no DHT). Covers: a push reaching every peer with the sender's peer id, a burst of changes
ending with the latest value everywhere, a malformed push refused, and admission (real credentials: a worker of
another stage is refused and changes nothing, and the refusal is counted).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hivemind.p2p import P2P

from agoractl.algorithms.progress import PeerProgress
from agoractl.auth import credential, keys
from agoractl.runtime.peer_auth import PeerAuth
from agoractl.runtime.progress_push import ProgressPush, read_progress
from agoractl.runtime.transport import pack

NS = "test-run.head.progress"


class Replica:
    """One ProgressPush on its own P2P and loop thread; `heard` collects what it took in, in order."""

    def __init__(self, initial: list, gate=None, token=lambda: None):
        self.heard: list[tuple[str, PeerProgress]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.push = ProgressPush(NS, lambda peer, p: self.heard.append((peer, p)), gate=gate, token=token)
        self.p2p = self.call(P2P.create(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        self.call(self.push.open(self.p2p))
        self.peer = self.p2p.peer_id.to_base58()
        self.maddrs = self.call(self.p2p.get_visible_maddrs())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        try:
            self.call(self.push.close())
            self.call(self.p2p.shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)


@pytest.fixture
def replicas():
    made: list[Replica] = []

    def make(n: int, gates=None, tokens=None) -> list[Replica]:
        for i in range(n):
            made.append(Replica([a for r in made for a in r.maddrs], gate=gates[i] if gates else None,
                                token=tokens[i] if tokens else lambda: None))
        return made

    yield make
    for r in made:
        r.close()


def wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_push_reaches_every_peer_under_the_senders_id(replicas):
    a, b, c = replicas(3)
    a.push.push([b.peer, c.peer], PeerProgress(3, 40, 112))
    wait_for(lambda: b.heard and c.heard and a.push.counts["sent"] == 2)  # a counts a push once its answer came
    assert b.heard == [(a.peer, PeerProgress(3, 40, 112))] and c.heard == b.heard
    assert a.push.counts["failed"] == 0
    assert b.push.counts["received"] == 1 and not a.heard


def test_a_burst_of_changes_ends_with_the_latest_value(replicas):
    """Changes made while a push is on its way are not queued one by one: the latest is sent after it."""
    a, b = replicas(2)
    for total in range(1, 201):
        a.push.push([b.peer], PeerProgress(total // 16, total, total))
    wait_for(lambda: b.heard and b.heard[-1][1].total == 200 and a.push.counts["sent"] == len(b.heard))
    time.sleep(0.3)  # nothing more comes
    totals = [p.total for _, p in b.heard]
    assert totals == sorted(totals) and totals[-1] == 200
    assert len(totals) < 200  # coalesced: the values changed faster than pushes went out
    assert a.push.counts["sent"] == len(totals) and a.push.counts["failed"] == 0


def test_a_malformed_push_is_refused():
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        read_progress({"step": -1, "total": 3})
    with pytest.raises(ValueError, match="total must be a non-negative integer"):
        read_progress({"step": 1, "total": "3"})
    assert read_progress({"step": 2, "total": 5}) == PeerProgress(2, 5, 0)


def test_a_malformed_push_over_the_wire_changes_nothing(replicas):
    a, b = replicas(2)

    async def send():
        stub = ProgressPush.get_stub(a.p2p, b.p2p.peer_id, namespace=NS)
        await stub.rpc_progress(pack({}, {"step": 1, "total": True}), timeout=10)

    with pytest.raises(Exception, match="total must be a non-negative integer"):
        a.call(send())
    assert not b.heard and b.push.counts["received"] == 0


def test_admission_refuses_a_push_from_another_stages_worker(replicas):
    """Real credentials (agoractl.auth) checked by PeerAuth.gate_replica: a head replica takes a head peer's
    push and refuses a body worker's, counting it under progress_push."""
    key = keys.generate()
    auth = [PeerAuth("test-run", keys.public_text(key)) for _ in range(3)]
    tokens: list = [None] * 3
    a, b, c = replicas(3, gates=[x.gate_replica("head", "progress_push") for x in auth],
                       tokens=[lambda i=i: tokens[i] for i in range(3)])
    for i, (r, stage) in enumerate(zip((a, b, c), ["head", "head", "body-1"])):
        tokens[i] = credential.issue(key, run="test-run", node_id=f"n{i}", account="x", role="worker", stage=stage,
                                     peer_id=r.peer, ttl_s=300, serial=1)
    c.push.push([a.peer], PeerProgress(9, 900, 900))
    b.push.push([a.peer], PeerProgress(1, 20, 36))
    wait_for(lambda: a.heard and c.push.counts["failed"] == 1)
    assert a.heard == [(b.peer, PeerProgress(1, 20, 36))]
    assert a.push.counts["refused"] == 1
    assert auth[0].stats()["refused"] == {"progress_push:wrong_stage": 1}
