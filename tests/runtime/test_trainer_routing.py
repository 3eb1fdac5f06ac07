"""A trainer's block order (agoractl.runtime.trainer_routing): in a pipeline of replicas on their own counts
(``data_parallel.fgdiloco.replicas`` = M), block n of the trainer's samples waits until block n - M, the same
replica's previous block, finished (its backward may complete the replica's step; a forward of the next step's
samples must not run on the weights before it). A whole model's blocks (one fused call each) run in any order.
The swarm whose losses this makes equal to the simulator's: tests/runtime/test_fgdiloco_worker.py."""

from __future__ import annotations

import asyncio
import collections
import threading

from agoractl.manifest.loader import load_manifest
from agoractl.runtime.trainer_routing import TrainerRouting
from tests.conftest import MANIFESTS


class Blocks(TrainerRouting):
    """The attributes of a trainer that the block order reads."""

    def __init__(self, manifest: str, sets: list[str] = ()):
        self.run = load_manifest(MANIFESTS / manifest, list(sets))
        self.stages = self.run.stage_names()
        self.routes = {s: object() for s in self.stages} if self.run.replica_batch else None
        self.stop = threading.Event()
        self._unfinished: collections.Counter = collections.Counter()
        self._blocks_changed = asyncio.Condition()


async def started(coro) -> asyncio.Task:
    task = asyncio.ensure_future(coro)
    for _ in range(5):  # let it run up to its wait
        await asyncio.sleep(0)
    return task


def test_a_pipeline_replicas_next_block_waits_for_its_previous_one():
    async def main():
        t = Blocks("fgdiloco-local-cpu.yaml")  # M = 2, blocks of 4 samples
        for sample in (0, 4, 8):
            t._open_blocks(sample, 4)
        await t._await_turn(0, 4)  # blocks 0 and 1: nothing before them
        await t._await_turn(4, 4)
        third = await started(t._await_turn(8, 4))  # block 2: replica 0's next, after block 0
        assert not third.done()
        await t._close_blocks(4, 4)  # the other replica's block finishing changes nothing
        await asyncio.sleep(0)
        assert not third.done()
        await t._close_blocks(0, 2)  # half of block 0 (microbatches of 2): still waiting
        await asyncio.sleep(0)
        assert not third.done()
        await t._close_blocks(2, 2)
        await asyncio.wait_for(third, 5)

    asyncio.run(main())


def test_a_stopping_trainer_is_not_held_and_a_whole_models_blocks_are_not_ordered():
    async def main():
        t = Blocks("fgdiloco-local-cpu.yaml")
        t._open_blocks(0, 4)
        t._open_blocks(8, 4)
        waiting = await started(t._await_turn(8, 4))
        t.stop.set()
        await t._close_blocks(8, 0)  # any change wakes the waiters; a stopping trainer goes on (to its end)
        await asyncio.wait_for(waiting, 5)
        whole = Blocks("fgdiloco-dp-cpu.yaml", ["workers.self_feed=false", "local.trainers=1"])
        whole._open_blocks(0, 4)
        whole._open_blocks(8, 4)
        await asyncio.wait_for(whole._await_turn(8, 4), 5)
        assert not whole._unfinished  # nothing tracked without an order

    asyncio.run(main())
