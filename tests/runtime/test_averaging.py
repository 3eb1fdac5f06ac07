"""The stage averaging transport (agoractl.runtime.averaging) between real processes over loopback libp2p.

Each peer is a subprocess (tests/runtime/sparta_peer.py) with its own DHT node and StageAverager;
the test process hosts the seed DHT. Covers: the weighted average, contributors (client mode, no
reduction), weight-0 peers absorbing without moving the others, a group of weight-0 peers, a
contributor preempted during send, a lost operator (the survivor's record counts only values mixed with
a groupmate's), a reducer preempted during reduce, bytes per round against
the payload, a peer sending NaN or huge values (dropped by the reducers, its slice left partial: no
honest peer's values become non-finite or jump, and every value recorded averaged holds the honest average).
Takes about a minute on a loaded 2-core machine. One more test, in-process and without network,
feeds a real StageAllReduce a dropped part before the honest ones: the reducer's accounting behind "complete"; another
holds the averaged tensors' lock through a cancelled wait (`held`) and finds it free afterwards.
"""

import asyncio
import json
import multiprocessing
import selectors
import subprocess
import sys

import psutil
import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.compression import NoCompression, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from agoractl.runtime.allreduce import StageAllReduce, expected_round_bytes
from agoractl.runtime.averaging import StageAverager, held
from agoractl.algorithms.termination import EXIT_PREEMPTED
from tests.conftest import ROOT

SIZE = 1000
PAYLOAD = (SIZE + 7) * 4  # the averaged buffer: capacity values in fp32


def readline(proc, timeout):
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            raise TimeoutError(f"peer {proc.pid} said nothing for {timeout} s")
        return proc.stdout.readline()
    finally:
        sel.close()


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Swarm:
    def __init__(self, maddrs, roles, extra=()):
        self.procs = []
        self.children = []  # per peer: the processes it started (DHT node, p2p daemon, averager)
        for role in roles:
            cmd = [sys.executable, "-m", "tests.runtime.sparta_peer", "--role", role, "--size", str(SIZE),
                   "--expected", str(len(roles)), *extra]
            for m in maddrs:
                cmd += ["--initial-peer", m]
            self.procs.append(subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               text=True))
        self.ready = []  # per peer: what followed "ready" (admitted peers: peer id and multiaddrs)
        try:
            for p in self.procs:
                words = readline(p, 180).split()
                assert words[:1] == ["ready"], words
                self.ready.append(words[1:])
                self.children.append([c.pid for c in psutil.Process(p.pid).children(recursive=True)])
        except BaseException:  # no fixture will close a swarm that never started: kill every peer's tree now
            for p in self.procs:
                try:
                    tree = psutil.Process(p.pid)
                    for proc in [*tree.children(recursive=True), tree]:
                        proc.kill()
                except psutil.NoSuchProcess:
                    pass
                p.wait()
            raise

    def round(self, commands):
        """commands: one "WEIGHT VALUE EXPECTED [FAULT]" per peer (None = the peer is gone)."""
        live = [(p, c) for p, c in zip(self.procs, commands) if c is not None]
        for p, c in live:
            p.stdin.write(f"go {c}\n")
            p.stdin.flush()
        out = []
        for p, c in live:
            line = readline(p, 120)
            out.append(json.loads(line) if line else None)  # EOF: the peer exited
        return out

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for pid in (pid for pids in self.children for pid in pids):  # left behind (there should be none)
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass


@pytest.fixture(scope="module")
def seed():
    import hivemind

    torch.set_num_threads(1)
    dht = hivemind.DHT(start=True, startup_timeout=120)
    try:
        yield [str(a) for a in dht.get_visible_maddrs()]
    finally:
        dht.shutdown()


@pytest.fixture
def swarm(seed, request):
    roles, extra = (request.param, ()) if isinstance(request.param, list) else request.param
    s = Swarm(seed, roles, extra)
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("swarm", [["operator", "operator", "contributor"]], indirect=True)
def test_weighted_average_contributors_absorb_and_preempted_sender(swarm):
    # Samples-weighted average over operators and a contributor.
    recs = swarm.round(["1 0 3", "3 4 3", "2 10 3"])
    for r in recs:
        assert r["status"] == "complete" and r["group_size"] == 3 and r["reducers"] == 2
        assert r["first"] == pytest.approx(32 / 6) and r["last"] == pytest.approx(32 / 6)
        assert r["averaging_success"] == 1.0
    assert recs[0]["reduce_success"] == recs[1]["reduce_success"] == 1.0
    assert recs[2]["reduce_success"] is None  # a contributor reduces nothing
    # Bytes on the wire: the payload x 2 for a contributor, the butterfly share for an operator (+ framing).
    contributor = recs[2]["bytes_sent"] + recs[2]["bytes_received"]
    assert contributor == pytest.approx(expected_round_bytes(PAYLOAD, 3, 2, False), rel=0.1)
    operator = recs[0]["bytes_sent"] + recs[0]["bytes_received"]
    assert operator == pytest.approx(expected_round_bytes(PAYLOAD, 3, 2, True), rel=0.1)

    # A weight-0 peer (sync phase) absorbs the consensus without moving it.
    recs = swarm.round(["1 0 3", "3 4 3", "0 100 3"])
    assert [r["first"] for r in recs] == pytest.approx([3.0, 3.0, 3.0])
    assert all(r["status"] == "complete" for r in recs)

    # Nobody has samples: nothing to average, everyone keeps its values (no 0/0).
    recs = swarm.round(["0 1 3", "0 2 3", "0 3 3"])
    assert [r["status"] for r in recs] == ["empty"] * 3

    # The contributor is preempted after its first chunk: the others' round completes, every value
    # of theirs comes back averaged; the reducers saw part of the contributor's values only.
    recs = swarm.round(["1 0 3", "3 4 3", "2 10 3 send"])
    assert recs[2] is None
    assert swarm.procs[2].wait(timeout=30) == EXIT_PREEMPTED
    for r in recs[:2]:
        assert r["status"] == "complete" and r["averaging_success"] == 1.0
        assert r["first"] in (pytest.approx(3.0), pytest.approx(32 / 6))
    assert min(r["reduce_success"] for r in recs[:2]) < 1.0
    assert len(swarm.children[2]) >= 3 and not any(alive(pid) for pid in swarm.children[2])

    # The next round is whole again between the two operators.
    recs = swarm.round(["1 0 2", "1 4 2", None])
    assert all(r["status"] == "complete" and r["first"] == pytest.approx(2.0) for r in recs), recs

    # A lost peer: the second operator is preempted after its first chunk. The survivor's record says what it
    # got: of its own slice only the values whose part arrived were mixed (reduced from its own values alone, the
    # rest come back finite but unmixed), and of the slice the lost one reduced only what it returned before it
    # died (often nothing; under load a chunk or two, or the lost one dies before the survivor's stream opens and
    # nothing at all arrives: a failed round). Its success is the values mixed, in line with the bytes it
    # received; it was 0.5 whatever arrived.
    recs = swarm.round(["1 0 2", "1 4 2 send", None])
    assert recs[1] is None and swarm.procs[1].wait(timeout=30) == EXIT_PREEMPTED
    r = recs[0]
    assert r["status"] in ("partial", "failed") and r["averaging_success"] < 1, r
    assert (r["status"] == "failed") == (r["averaging_success"] == 0), r
    mixed_bytes = r["averaging_success"] * SIZE * 4
    assert mixed_bytes == pytest.approx(r["bytes_received"], rel=0.3), r  # chunks of 1 KB, plus framing
    if r["status"] == "partial":  # each value mixed: (0 + 4) / 2
        assert r["average_sum"] == pytest.approx(2.0 * r["averaging_success"] * SIZE), r


@pytest.mark.parametrize("swarm", [["operator", "operator", "operator", "contributor"]], indirect=True)
def test_reducer_preempted_during_reduce_leaves_one_partial_round(swarm):
    recs = swarm.round(["1 0 4", "1 1 4", "1 2 4", "1 3 4"])
    assert all(r["status"] == "complete" and r["first"] == pytest.approx(1.5) for r in recs)

    recs = swarm.round(["1 0 4", "1 1 4", "1 2 4 reduce", "1 3 4"])
    assert recs[2] is None and swarm.procs[2].wait(timeout=30) == EXIT_PREEMPTED
    assert not any(alive(pid) for pid in swarm.children[2])
    # The reducer died holding its first reduced chunk: every other peer keeps its local values for
    # the slice that reducer averages (its share of the chunks, sized by hivemind's load balancing: about
    # a third here, half in some runs) and gets the rest averaged.
    survivors = [recs[0], recs[1], recs[3]]
    for r in survivors:
        assert r["status"] == "partial" and 0.25 < r["averaging_success"] < 1 and r["not_averaged"] > 0
    assert len({r["averaging_success"] for r in survivors}) == 1  # the same slice is missing everywhere

    recs = swarm.round(["1 0 3", "1 1 3", None, "1 5 3"])
    assert all(r["status"] == "complete" and r["averaging_success"] == 1.0 for r in recs)
    assert all(r["first"] == pytest.approx(2.0) for r in recs)


@pytest.mark.parametrize("swarm", [(["operator", "operator", "operator"], ("--part-multiple", "10",
                                                                         "--allreduce-timeout", "20"))], indirect=True)
def test_a_peer_sending_nan_or_huge_parts_cannot_move_honest_replicas(swarm):
    # The NaN round ends at the all-reduce timeout (60 s by default; 20 s here): a round of these peers
    # otherwise takes a fraction of a second, so 20 s still leaves the honest parts ample time.
    for bad in ("nan", "1e7"):
        recs = swarm.round(["1 1 3", "1 2 3", f"1 {bad} 3"])
        honest = recs[:2]
        for r in honest:
            assert r["status"] in ("partial", "complete") and r["averaging_success"] > 0, r
            assert r["reducers"] == 3, r  # the bad peer reduces a slice too
            assert 1.0 <= r["first"] <= 2.0 and 1.0 <= r["last"] <= 2.0, r  # finite, never a jump
            # Every value recorded averaged holds the honest average; a round is complete only if all are.
            assert r["average_sum"] == pytest.approx(1.5 * (SIZE - r["not_averaged"])), r
            assert (r["status"] == "complete") == (r["not_averaged"] == 0), r
        if bad == "1e7":  # its slice (the huge average it reduced) comes back unusable: partial there
            assert all(r["status"] == "partial" for r in honest), honest
        # (a NaN peer drops its own part at its own slice and returns the honest average: complete is right)
        assert sum(r["dropped_parts"] for r in honest) >= 1  # the honest reducers dropped its parts
        assert recs[2]["status"] in ("partial", "failed"), recs[2]  # ... which come back to it not averaged
    recs = swarm.round(["1 1 3", "1 2 3", "1 3 3"])  # healthy again: nothing is held against it
    assert all(r["status"] == "complete" and r["first"] == pytest.approx(2.0) for r in recs), recs


def test_a_dropped_part_takes_only_its_sender_off_the_reducers_part():
    """The accounting behind "complete" (no network: one real StageAllReduce fed the way hivemind feeds it).
    A groupmate's NaN part reaches this reducer first, then its own part, then the other honest groupmate's:
    the part is averaged over both honest values. (It once went without the last one - the bad sender was
    taken off the part twice - and the early finisher got a zero delta: recorded averaged, left local.)"""
    me, honest, bad = (PeerID(bytes([i]) * 34) for i in (1, 2, 3))

    async def scenario():
        runner = StageAllReduce(
            p2p=type("P2P", (), {"peer_id": me})(), servicer_type=StageAverager, prefix="t", group_id=b"g",
            tensors=[torch.full((8,), 1.0)], weight=1.0, ordered_peer_ids=[me, honest, bad],
            peer_fractions=(1.0, 0.0, 0.0), modes=[AveragingMode.NODE] * 3, sender_timeout=5.0,
            reducer_timeout=10.0, wire=NoCompression(), fault=None, on_fault=lambda point: None, part_multiple=10.0)

        async def send(peer, value) -> list:
            async def stream():
                yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"g", weight=1.0,
                                                  tensor_part=serialize_torch_tensor(torch.full((8,), value)))
            return [m async for m in runner.rpc_aggregate_part(stream(), P2PContext("h", me, peer))]

        assert [m.code for m in await send(bad, float("nan"))] != [averaging_pb2.AVERAGED_PART]
        own = asyncio.create_task(runner.tensor_part_reducer.accumulate_part(0, 0, torch.full((8,), 1.0), 1.0))
        await asyncio.sleep(0.05)
        assert not own.done()  # the honest groupmate's values are still due
        replies = await send(honest, 2.0)
        assert [m.code for m in replies] == [averaging_pb2.AVERAGED_PART]
        assert torch.equal(await own, torch.full((8,), 1.5))
        assert runner.dropped_parts == 1 and runner.banned_senders == {bad}
        expected, received = runner.reduce_counts()
        assert (expected, received) == (24, 16)  # the bad sender's values are the ones missing

    asyncio.run(scenario())


def test_the_averaged_tensors_lock_outlives_a_cancel_during_its_wait():
    """`held` (StageAverager's all-reduce takes its tensors through it): the all-reduce timeout cancels the wait for
    the lock while the host holds it (copying a round in); the executor thread takes it after the cancel, and it
    comes back free. hivemind's own ``enter_asynchronously`` kept it: the worker's next round blocked forever."""
    lock = multiprocessing.Lock()

    async def use():
        async with held(lock):
            await asyncio.sleep(1)

    async def scenario():
        lock.acquire()  # the host process, mid-copy
        task = asyncio.create_task(asyncio.wait_for(use(), 0.001))
        await asyncio.sleep(0.1)
        assert not task.done() or isinstance(task.exception(), asyncio.TimeoutError)
        lock.release()  # the waiting thread takes it now, for a coroutine that is gone
        with pytest.raises(asyncio.TimeoutError):
            await task
        for _ in range(200):  # its release runs on the loop, once the thread's acquire returned
            if lock.acquire(block=False):
                lock.release()
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(scenario()), "the lock stayed taken after the cancelled wait"

    async def normal():
        async with held(lock):
            assert not lock.acquire(block=False)  # taken while held
        assert lock.acquire(block=False)
        lock.release()

    asyncio.run(normal())
