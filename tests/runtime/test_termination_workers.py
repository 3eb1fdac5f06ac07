"""Self-termination of real worker processes (report §3.3.1.6): ``launch worker`` subprocesses on a DHT the
test process hosts, with the test acting as the trainer (real forward/backward RPCs over libp2p).

- a worker sent a NaN output gradient refuses the request (it never reaches its gradients) and
  serves on; a worker whose own backward turns NaN (the ``--fault nan-grads`` drill, a broken GPU)
  exits with the ``nan_gradients`` code at its next step, its last log line naming the rule;
- a worker whose averaging rounds cannot finish (an all-reduce timeout no round can meet) fails
  two of its last three rounds and exits with the ``allreduce_failures`` code, while its two
  healthy peers keep averaging with each other.

About a minute on a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from agoractl.algorithms.termination import EXIT_CODES
from tests.conftest import MANIFESTS

# Real worker processes, but no trainers and no swarm: light enough to run beside the swarm tests.
pytestmark = [pytest.mark.swarm, pytest.mark.xdist_group("workers")]
MANIFEST = MANIFESTS / "local-cpu.yaml"
TINY = ["model.seq_len=64", "trainers.microbatch=1", "stages=[{role: head, layers: 2}, {role: tail, layers: 2}]",
        "workers.announce_period_s=1", "network.startup_timeout_s=90", "data_parallel.method=sparta",
        "data_parallel.sparta.fraction=0.25", "data_parallel.sparta.every_steps=1",
        "data_parallel.sparta.matchmaking_timeout_s=5", "data_parallel.sparta.chunk_timeout_s=2"]


@pytest.fixture(scope="module")
def seed():
    import hivemind

    dht = hivemind.DHT(start=True, startup_timeout=120)
    try:
        yield dht, [str(a) for a in dht.get_visible_maddrs()]
    finally:
        dht.shutdown()


class Workers:
    def __init__(self, tmp, maddrs):
        self.tmp, self.maddrs, self.procs = tmp, maddrs, {}

    def start(self, name, role, *values, args=()):
        argv = [sys.executable, "-m", "agoractl", "launch", "worker", str(MANIFEST), "--stage", "head", *args,
                "--role", role, "--stats", str(self.tmp / f"{name}.json"),
                *[a for m in self.maddrs for a in ("--initial-peers", m)],
                *[a for v in [*TINY, f"checkpoints.store={self.tmp / 'store'}", *values] for a in ("--set", v)]]
        self.procs[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(self.tmp / f"{name}.err", "wb"),
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    def log(self, name) -> list[dict]:
        out = []
        for line in (self.tmp / f"{name}.err").read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def kill_all(self):
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait(10)


@pytest.fixture
def workers(seed, tmp_path):
    w = Workers(tmp_path, seed[1])
    try:
        yield w
    finally:
        w.kill_all()


def head_peers(dht, want: int, timeout: float = 240) -> dict:
    """{pid: peer id} of the head workers once `want` of them announced themselves."""
    from agoractl.runtime.records import RunRecords

    records = RunRecords(dht, "local-cpu")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = records.stage_workers("head")
        if len(found) >= want:
            return {r.pid: peer for peer, r in found.items()}
        time.sleep(0.5)
    raise AssertionError(f"fewer than {want} head workers announced themselves")


async def sample(client, peer: str, grad_fill: float | None = None) -> None:
    """One sample through `peer` as a trainer sends it: forward, then backward (a NaN gradient if asked)."""
    ids = torch.randint(0, 256, (1, 65), dtype=torch.int32)
    out, _ = await client.call(peer, "head", "forward", {"ids": ids}, timeout=60)
    grad = torch.randn_like(out["wire"]) * 1e-3 if grad_fill is None else torch.full_like(out["wire"], grad_fill)
    await client.call(peer, "head", "backward", {"ids": ids, "grad": grad}, timeout=60)


async def client_of(dht):
    from agoractl.runtime.transport import StageClient

    return StageClient(await dht.replicate_p2p(), "local-cpu")


@pytest.fixture
def trainer(seed):
    """The test's trainer node: a client of the DHT of its own (hivemind ties a DHT's P2P replica to the
    event loop that made it, and every test runs its own loop)."""
    import hivemind

    dht = hivemind.DHT(initial_peers=seed[1], client_mode=True, start=True, startup_timeout=120)
    try:
        yield dht
    finally:
        dht.shutdown()


def test_nan_inputs_are_refused_and_own_nan_gradients_terminate_the_worker(trainer, workers):
    dht = trainer
    workers.start("n", "operator", "training.global_batch_size=1", "metadata.name=local-cpu",
                  args=("--fault", "nan-grads"))
    peer = head_peers(dht, 1)[workers.procs["n"].pid]

    async def feed():
        client = await client_of(dht)
        with pytest.raises(Exception, match="refused: grad holds .* non-finite"):
            await sample(client, peer, grad_fill=float("nan"))  # not its fault: refused, never computed
        await asyncio.sleep(1)
        assert workers.procs["n"].poll() is None
        for _ in range(4):  # valid inputs; from its ONSET-th batch on its own backward is NaN: its own rule fires
            if workers.procs["n"].poll() is not None:
                return
            await asyncio.gather(sample(client, peer), return_exceptions=True)  # it may leave mid-sample

    asyncio.run(feed())
    assert workers.procs["n"].wait(120) == EXIT_CODES["nan_gradients"]
    last = workers.log("n")[-1]
    assert last["event"] == "self-termination" and last["rule"] == "nan_gradients"
    assert "non-finite gradients" in last["message"]
    stats = json.loads((workers.tmp / "n.json").read_text())
    assert stats["termination"]["rule"] == "nan_gradients" and stats["step"] >= 2  # good steps first, then NaN


def test_a_worker_failing_two_of_three_rounds_terminates_itself(trainer, workers, tmp_path):
    dht = trainer
    values = ["training.global_batch_size=3", "metadata.name=local-cpu"]
    workers.start("a", "operator", *values)
    workers.start("b", "operator", *values)
    workers.start("f", "contributor", *values, "data_parallel.sparta.allreduce_timeout_s=0.001")
    pids = head_peers(dht, 3)
    a, b, f = (pids[workers.procs[n].pid] for n in "abf")

    async def feed():
        client = await client_of(dht)
        await asyncio.sleep(3)  # both have seen each other's record before the first round
        # A round per step of the stage (three samples). Each of f's rounds holds its averager until the round's
        # deadline (hivemind retries the failed all-reduce, and a and b have moved on), and its record is read
        # at f's next step: feed until f leaves, within a bound.
        deadline = time.monotonic() + 180
        while workers.procs["f"].poll() is None and time.monotonic() < deadline:
            # A call to f may meet it shutting down once it terminated itself (an error, or no answer: bounded).
            calls = asyncio.gather(sample(client, a), sample(client, b), sample(client, f), return_exceptions=True)
            try:
                await asyncio.wait_for(calls, 30)
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(1)

    asyncio.run(feed())
    assert workers.procs["f"].wait(120) == EXIT_CODES["allreduce_failures"]
    last = workers.log("f")[-1]
    assert last["event"] == "self-termination" and last["rule"] == "allreduce_failures"
    rounds = json.loads((tmp_path / "f.json").read_text())["rounds"]
    ran = [r["status"] for r in rounds if r["status"] in ("complete", "partial", "failed")]
    assert ran[-3:].count("failed") >= 2, rounds
    # Its healthy peers averaged on (with each other) and are still serving.
    for name in "ab":
        assert workers.procs[name].poll() is None
        assert not [e for e in workers.log(name) if e.get("event") == "self-termination"]
