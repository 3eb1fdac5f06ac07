"""The one stage optimizer step (agoractl.algorithms.optim.optimizer_step) as its call sites take it:
in-process workers of a pure pipeline, the centralized reference, the simulator's pipeline of stage
replicas and its full-model replica, trained on the same batches from the same initial weights, end
with the same parameters. In-process, no network."""

from __future__ import annotations

import torch

from agoractl.sim.simulator import PipelineSim, Replica
from agoractl.training.central import Central
from agoractl.training.worker import Worker
from tests.training.test_worker import call, samples, small_run


def _pipeline_of_workers(run, data):
    workers = [Worker(run, i) for i in range(3)]
    for s in data:
        ids = s[None]
        w1 = call(workers[0], "forward", ids)["wire"]
        w2 = call(workers[1], "forward", ids, w1)["wire"]
        out = call(workers[2], "forward_backward", ids, w2)
        g1 = call(workers[1], "backward", ids, w1, out["grad"])["grad"]
        call(workers[0], "backward", ids, None, g1)
    for w in workers:
        w.maybe_step()
        assert w.progress.step == 2
    return [dict(w.module.named_parameters()) for w in workers]


def test_worker_simulator_and_central_take_the_same_optimizer_step():
    run = small_run()
    data = samples(8, seed=1)
    batches = data.split(4)
    central = Central(run)
    initial = {n: p.detach().clone() for n, p in central.model.named_parameters()}
    norms = [central.step(b)[2] for b in batches]
    assert all(set(n) == set(run.stage_names()) and all(v > 0 for v in n.values()) for n in norms)
    reference = dict(central.model.named_parameters())
    assert all(not torch.equal(p, initial[n]) for n, p in reference.items() if p.ndim >= 2)  # it trained

    pipeline = PipelineSim(run, 1)
    for b in batches:
        pipeline.train_step(b, microbatch=1)
    replica = Replica(run)
    for b in batches:
        replica.inner_step(b)

    stages = {"workers": _pipeline_of_workers(run, data),
              "simulator pipeline": [dict(stage[0].params) for stage in pipeline.stages],
              "simulator replica": [dict(replica.model.named_parameters())]}
    for site, modules in stages.items():
        names = [n for m in modules for n in m]
        assert sorted(names) == sorted(reference), site
        for params in modules:
            for name, p in params.items():
                # Adam turns float noise in near-zero gradients into small update differences: far below lr.
                torch.testing.assert_close(p, reference[name], rtol=0, atol=1e-4, msg=f"{site}: {name}")
