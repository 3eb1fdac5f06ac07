"""FGDiLoCo's outer rounds in the worker (agoractl.training.fgdiloco_rounds), in one process.

Real :class:`Worker` replicas of one stage, their mixes exchanged through an in-process group (a
thread per replica, since Mix2 blocks): after every outer round the workers' weights equal what the
simulator's own ``outer_round`` makes of the same z and y_H, for every variant. The swarm over
hivemind: tests/runtime/test_fgdiloco_worker.py.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from agoractl.algorithms.fgdiloco import OuterSGD, mix, outer_round, variant_mixing
from agoractl.manifest.loader import load_manifest
from agoractl.training.fgdiloco_rounds import FGDiLoCoRounds
from agoractl.training.worker import Worker
from tests.conftest import MANIFESTS

H = 3


class InProcessGroup:
    """The transport between in-process replicas: each mix waits for every replica's values, then
    mixes them with the simulator's ``mix`` (two replicas: the local matching is the pair)."""

    def __init__(self, n: int):
        self.n, self.cond, self.values = n, threading.Condition(), {}

    def member(self, m: int):
        group = self

        class Mixing:
            def start(self, kind, index, values):
                with group.cond:
                    group.values.setdefault(index, {})[m] = values.clone()
                    group.cond.notify_all()
                return Handle(index)

        class Handle:
            def __init__(self, index):
                self.index = index

            def done(self):
                return len(group.values[self.index]) == group.n

            def result(self, timeout=None):
                with group.cond:
                    assert group.cond.wait_for(self.done, timeout=30), f"mix {self.index} never completed"
                    vals = [group.values[self.index][i] for i in range(group.n)]
                mixed = mix(kind_of(self.index), vals, [(0, 1)])
                return mixed[m], {"round": self.index, "status": "complete", "averaging_success": 1.0}

        return Mixing()


def kind_of(index):  # set per test: Mix1 on even indices, Mix2 on odd
    return KINDS[index % 2]


KINDS = ["none", "global"]


def flat(worker):
    return torch.cat([p.detach().reshape(-1) for p in worker.master]).clone()


@pytest.mark.parametrize("variant", ["diloco", "global_m1", "global_m1_local_m2", "local_m1_m2"])
def test_worker_outer_step_equals_the_simulators(variant):
    KINDS[:] = list(variant_mixing(variant))
    run = load_manifest(MANIFESTS / "fgdiloco-local-cpu.yaml", [
        "model.seq_len=16", "training.global_batch_size=4", "trainers.microbatch=1", "training.max_steps=100",
        f"data_parallel.fgdiloco.variant={variant}", f"data_parallel.fgdiloco.inner_steps={H}"])
    group = InProcessGroup(2)
    workers = [Worker(run, 0) for _ in range(2)]
    seen = {m: {} for m in range(2)}  # replica -> {step done: flat params before the outer step}
    for m, w in enumerate(workers):
        w.step_callbacks.append(lambda step, w, m=m: seen[m].__setitem__(step + 1, flat(w)))
    fgs = [FGDiLoCoRounds(run, w, group.member(m)) for m, w in enumerate(workers)]
    z0 = [flat(w) for w in workers]
    assert torch.equal(z0[0], z0[1])

    def train(m):
        w = workers[m]
        gen = torch.Generator().manual_seed(100 + m)  # replicas see different data
        fgs[m].start(0)
        for _ in range(2 * H):
            for p in w.params:
                p.grad = torch.randn(p.shape, generator=gen) * 0.1
            w.progress.add(2)
            w.step()

    threads = [threading.Thread(target=train, args=(m,)) for m in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    # The simulator's update for the same inputs: z at each round start, y_H at its end.
    opts = [OuterSGD(run.data_parallel.fgdiloco.outer_lr, run.data_parallel.fgdiloco.outer_momentum,
                     run.data_parallel.fgdiloco.nesterov) for _ in range(2)]
    z = z0
    for r in range(2):
        y = [seen[m][(r + 1) * H] for m in range(2)]
        z = outer_round(z, y, variant, opts, random.Random(0))
        if r == 0:  # the workers' next round started from these z
            for m in range(2):
                assert not torch.equal(y[m], z[m])
    for m, w in enumerate(workers):
        assert torch.equal(flat(w), z[m]), (variant, m, float((flat(w) - z[m]).abs().max()))
    assert [len(fg.records) for fg in fgs] == [4, 4]
    assert fgs[0].summary()["fgdiloco"]["outer_rounds"] == 2


def test_a_new_run_does_not_mix_its_identical_start():
    # Round 0 of a new run: every replica holds the same z, so Mix1 is skipped (recorded), never a group
    # that replicas started a moment apart could each find alone; a later round start does mix.
    run = load_manifest(MANIFESTS / "fgdiloco-dp-cpu.yaml",
                        ["model.seq_len=16", f"data_parallel.fgdiloco.inner_steps={H}"])
    started = []

    class Mixing:
        def start(self, kind, index, values):
            started.append(index)
            return Handle()

    class Handle:
        def done(self):
            return True

        def result(self, timeout=None):
            return torch.zeros(0), {"status": "failed"}

    fresh = FGDiLoCoRounds(run, Worker(run, 0), Mixing())
    fresh.start(0)
    assert fresh.round == 0 and started == []
    assert fresh.mix1.result()[1]["status"] == "skipped"
    later = FGDiLoCoRounds(run, Worker(run, 0), Mixing())
    later.start(2 * H)
    assert later.round == 2 and started == [4]
