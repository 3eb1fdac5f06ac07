"""The worker's compute (agoractl.training.worker): coalescing, queue choice, step boundaries (also while
a step callback waits), and a pure pipeline of in-process workers matching the centralized reference step
for step. In-process, no network (the multi-process swarm is tested in test_swarm.py)."""

from __future__ import annotations

import time

import torch

from agoractl.manifest.loader import load_manifest
from agoractl.training.central import clip_groups
from agoractl.model.build import build_model
from agoractl.model.llama import lm_loss, split_sample
from agoractl.algorithms.optim import lr_at, make_optimizer, set_lr
from agoractl.algorithms.progress import PeerProgress
from agoractl.training.worker import Task, Worker
from tests.conftest import MANIFESTS

SMALL = ["model.seq_len=16", "training.global_batch_size=4", "trainers.microbatch=1", "workers.max_microbatch=8",
         "training.max_steps=5", "training.schedule.warmup_steps=1"]


def small_run(*extra):
    return load_manifest(MANIFESTS / "local-cpu.yaml", SMALL + list(extra))


def samples(n: int, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, seq_len + 1), generator=torch.Generator().manual_seed(seed))


class Box:
    def __init__(self):
        self.result = self.error = None
        self.done = False

    def __call__(self, result, error):
        self.result, self.error, self.done = result, error, True


def submit(w: Worker, method: str, ids, wire=None, grad=None) -> Box:
    box = Box()
    w.submit(Task(method, ids, wire, grad, box))
    return box


def call(w: Worker, method: str, ids, wire=None, grad=None) -> dict:
    box = submit(w, method, ids, wire, grad)
    while not box.done:
        w.run_once(0.01)
    if box.error is not None:
        raise box.error
    return box.result


def test_coalescing_merges_queued_requests_and_splits_results_back():
    run = small_run()
    head = Worker(run, 0)
    ids = samples(3)
    alone = [call(head, "forward", ids[i:i + 1])["wire"] for i in range(3)]
    boxes = [submit(head, "forward", ids[i:i + 1]) for i in range(3)]
    assert head.run_once(0.01)  # one pass serves all three
    assert all(b.done for b in boxes) and head.stats.max_coalesced == 3
    for b, a in zip(boxes, alone):
        assert b.result["wire"].shape == (1, 16, run.model.ssn.rank)
        torch.testing.assert_close(b.result["wire"], a, rtol=1e-5, atol=1e-5)


def test_the_queue_with_the_oldest_request_goes_first():
    run = small_run()
    body = Worker(run, 1)
    ids = samples(2)
    wire = torch.randn(1, 16, run.model.ssn.rank)
    old = submit(body, "backward", ids[:1], wire, torch.randn(1, 16, run.model.ssn.rank))
    new = submit(body, "forward", ids[1:], wire)
    body.run_once(0.01)
    assert old.done and not new.done
    body.run_once(0.01)
    assert new.done and old.result["grad"].shape == wire.shape


def test_a_coalesced_batch_stops_at_the_step_boundary():
    run = small_run()  # global batch 4, coalescing cap 8
    tail = Worker(run, 2)
    ids = samples(6)
    wire = torch.randn(6, 16, run.model.ssn.rank)
    boxes = [submit(tail, "forward_backward", ids[i:i + 1], wire[i:i + 1]) for i in range(6)]
    tail.run_once(0.01)
    assert sum(b.done for b in boxes) == 4 and tail.progress.step == 0
    tail.run_once(0.01)  # steps first, then serves the other two toward step 1
    assert all(b.done for b in boxes) and tail.progress.step == 1 and tail.progress.samples == 2
    assert tail.stats.steps[0][2] == 4
    assert all(float(b.result["loss"]) > 0 for b in boxes)


def test_serving_without_stepping_holds_gradient_work_past_the_batch_but_answers_forwards():
    # what a worker does while a SPARTA round waits for the previous one (it cannot step until it returns)
    run = small_run()  # global batch 4
    tail, body = Worker(run, 2), Worker(run, 1)
    ids = samples(6)
    wire = torch.randn(6, 16, run.model.ssn.rank)
    boxes = [submit(tail, "forward_backward", ids[i:i + 1], wire[i:i + 1]) for i in range(6)]
    forward = submit(body, "forward", ids[:1], wire[:1])
    tail.serve_once(0.01, stepping=False)
    assert sum(b.done for b in boxes) == 4 and tail.progress.room() == 0
    assert not tail.serve_once(0.01, stepping=False) and sum(b.done for b in boxes) == 4  # held for the step
    t0 = time.monotonic()  # with only held work queued, it waits for new requests rather than spin
    assert not tail.serve_once(0.2, stepping=False) and time.monotonic() - t0 >= 0.15
    assert body.serve_once(0.01, stepping=False) and forward.done and forward.error is None
    tail.run_once(0.01)  # the step, then the held work
    assert all(b.done for b in boxes) and tail.progress.step == 1 and tail.stats.steps[0][2] == 4


def test_bad_requests_fail_without_killing_the_worker():
    run = small_run()
    body = Worker(run, 1)
    box = submit(body, "forward", samples(1), torch.randn(1, 7, run.model.ssn.rank))
    assert isinstance(box.error, ValueError) and "refused: wire has shape (1, 7, 16)" in str(box.error)
    nan = submit(body, "forward", samples(1), torch.full((1, 16, run.model.ssn.rank), float("nan")))
    assert "refused: wire holds 256 non-finite value(s)" in str(nan.error)  # never reaches the compute
    assert body.stats.refused == 2 and body.stats.failed_batches == 0 and not body.queued()
    assert body.stats.checks_s > 0  # what the checks cost, in the worker's stats
    assert isinstance(submit(body, "forward_backward", samples(1)).error, ValueError)  # not the tail
    ok = call(body, "forward", samples(1), torch.randn(1, 16, run.model.ssn.rank))
    assert ok["wire"].shape == (1, 16, run.model.ssn.rank)


def test_a_backward_the_cache_does_not_serve_is_refused_on_bad_inputs_alone():
    """With the activation cache a backward's ids and wire are checked only when the cache does not serve it
    (a served one runs on the graph of a forward this worker checked): a bad one is refused before the
    recompute, and the requests coalesced with it are computed."""
    run = small_run()
    body = Worker(run, 1)
    assert body.cache is not None
    k = run.model.ssn.rank
    ids, wire, grad = samples(3), torch.randn(3, 16, k), torch.randn(3, 16, k)
    served = submit(body, "forward", ids[:1], wire[:1])
    body.run_once(0.01)
    nan_wire = torch.full((1, 16, k), float("nan"))
    boxes = [submit(body, "backward", ids[:1], wire[:1], grad[:1]),  # served by the cache
             submit(body, "backward", ids[1:2], nan_wire, grad[1:2]),  # not cached: recompute, refused
             submit(body, "backward", ids[2:3] + 300, wire[2:3], grad[2:3]),  # ids outside the vocabulary
             submit(body, "backward", ids[1:2], wire[1:2], grad[1:2])]  # not cached: recomputed
    assert served.error is None and not any(b.done for b in boxes)  # structure fine: queued
    body.run_once(0.01)
    assert all(b.done for b in boxes) and body.stats.failed_batches == 0 and body.stats.refused == 2
    assert "refused: wire holds 256 non-finite value(s)" in str(boxes[1].error)
    assert "refused: ids hold token ids outside [0, 257)" in str(boxes[2].error)
    assert boxes[0].error is None and boxes[3].error is None and boxes[3].result["grad"].isfinite().all()
    assert body.progress.samples == 2 and body.stats.cache["hits"] == 1 and body.stats.cache["misses"] == 3
    assert all(p.grad is None or p.grad.isfinite().all() for p in body.params)
    nan_grad = submit(body, "backward", ids[:1], wire[:1], torch.full((1, 16, k), float("inf")))
    assert "refused: grad holds" in str(nan_grad.error)  # the output gradient: always checked at once
    lone = submit(body, "backward", ids[1:2], nan_wire, grad[1:2])
    body.run_once(0.01)  # a batch of nothing but refused requests
    assert "refused" in str(lone.error) and body.stats.failed_batches == 0 and body.progress.samples == 2


def test_pure_pipeline_of_workers_matches_the_centralized_reference():
    """One replica per stage, samples one at a time: after two steps the stage parameters equal the
    monolithic model's trained on the same batches (same init, mean gradient, clipping, schedule)."""
    run = small_run()
    workers = [Worker(run, i) for i in range(3)]
    data = samples(8, seed=1)
    losses = []
    for s in data:
        ids = s[None]
        w1 = call(workers[0], "forward", ids)["wire"]
        w2 = call(workers[1], "forward", ids, w1)["wire"]
        out = call(workers[2], "forward_backward", ids, w2)
        losses.append(float(out["loss"]))
        g1 = call(workers[1], "backward", ids, w1, out["grad"])["grad"]
        assert "grad" not in call(workers[0], "backward", ids, None, g1)  # nothing flows out of the head
    for w in workers:
        w.maybe_step()
        assert w.progress.step == 2 and [s[2] for s in w.stats.steps] == [4, 4]

    model = build_model(run)
    opt = make_optimizer(model.parameters(), run)
    groups = clip_groups(run, model)
    central_losses = []
    for step, batch in enumerate(data.split(4)):
        set_lr(opt, lr_at(run, step))
        opt.zero_grad(set_to_none=True)
        inputs, labels = split_sample(batch)
        loss = lm_loss(model(inputs), labels)
        loss.backward()
        central_losses.append(float(loss.detach()))
        for _, params, threshold in groups:
            torch.nn.utils.clip_grad_norm_(params, threshold)
        opt.step()
    torch.testing.assert_close(sum(losses[:4]) / 4, central_losses[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sum(losses[4:]) / 4, central_losses[1], rtol=1e-4, atol=1e-4)
    central = dict(model.named_parameters())
    for w in workers:
        for name, p in w.module.named_parameters():
            # Adam turns float noise in near-zero gradients into small update differences: far below lr.
            torch.testing.assert_close(p, central[name], rtol=0, atol=1e-4)


def test_a_whole_model_worker_answers_forward_backward_alone_and_matches_central():
    """Role whole: ids in, per-sample losses out (no wire, no input gradient); forward and backward are
    refused; after two steps the replica equals the centralized model trained on the same batches."""
    run = small_run("stages=[{role: whole, layers: 4}]", "model.ssn.rank=null")
    worker = Worker(run, 0)
    refused = submit(worker, "forward", samples(1))
    assert isinstance(refused.error, ValueError) and "forward_backward only" in str(refused.error)
    data = samples(8, seed=1)
    losses = []
    for pair in data.split(2):
        out = call(worker, "forward_backward", pair)
        assert "grad" not in out and out["loss"].shape == (2,)
        losses.extend(out["loss"].tolist())
    worker.maybe_step()
    assert worker.progress.step == 2 and [s[2] for s in worker.stats.steps] == [4, 4]

    model = build_model(run)
    opt = make_optimizer(model.parameters(), run)
    (_, params, threshold), = clip_groups(run, model)
    central_losses = []
    for step, batch in enumerate(data.split(4)):
        set_lr(opt, lr_at(run, step))
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(split_sample(batch)[0]), split_sample(batch)[1])
        loss.backward()
        central_losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(params, threshold)
        opt.step()
    torch.testing.assert_close(sum(losses[:4]) / 4, central_losses[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sum(losses[4:]) / 4, central_losses[1], rtol=1e-4, atol=1e-4)
    central = dict(model.named_parameters())
    for name, p in worker.module.named_parameters():
        torch.testing.assert_close(p, central[name], rtol=0, atol=1e-4)



def test_a_replica_on_its_own_count_steps_on_its_batch_then_answers_finished_untrained():
    """FGDiLoCo with M = 2 (data_parallel.fgdiloco.replicas): global batch 4, so this replica steps every 2
    samples of its own whatever its peers did; after max_steps it trains nothing and says it is finished."""
    run = small_run("stages=[{role: whole, layers: 4}]", "model.ssn.rank=null", "data_parallel.method=fgdiloco",
                    "data_parallel.fgdiloco.replicas=2", "data_parallel.fgdiloco.inner_steps=10",
                    "training.max_steps=2")
    worker = Worker(run, 0)
    worker.progress.observe({"peer": PeerProgress(step=5, total=50)})  # a peer far ahead: no reason to step
    for pair in samples(4, seed=2).split(2):
        out = call(worker, "forward_backward", pair)
        assert out["step"] == worker.progress.step
        worker.maybe_step()
    assert worker.progress.step == 2 and [s[2] for s in worker.stats.steps] == [2, 2]
    weights = [p.detach().clone() for p in worker.params]
    late = call(worker, "forward_backward", samples(2, seed=3))
    assert late == {"finished": True, "step": 2} and worker.stats.finished_replies == 1
    assert worker.stats.backward_samples == 4 and all(torch.equal(a, b) for a, b in zip(weights, worker.params))


def test_a_replica_on_its_own_count_in_a_blocking_mix_answers_waiting_and_takes_no_work():
    """The first replica at a round's Mix2 must not sit on requests its peers need to get there (they starved,
    and the mix timed out): held, it answers queued and new requests "waiting" at once, untrained."""
    run = small_run("stages=[{role: whole, layers: 4}]", "model.ssn.rank=null", "data_parallel.method=fgdiloco",
                    "data_parallel.fgdiloco.replicas=2")
    worker = Worker(run, 0)
    queued = submit(worker, "forward_backward", samples(2, seed=4))
    worker.hold(True)
    assert queued.result == {"waiting": True, "step": 0}
    assert submit(worker, "forward_backward", samples(2, seed=5)).result == {"waiting": True, "step": 0}
    assert worker.stats.waiting_replies == 2 and worker.stats.backward_samples == 0 and worker.queued() == 0
    worker.hold(False)
    assert "loss" in call(worker, "forward_backward", samples(2, seed=6)) and worker.stats.backward_samples == 2
    collective = Worker(small_run("stages=[{role: whole, layers: 4}]", "model.ssn.rank=null"), 0)
    collective.hold(True)  # counting collectively, replicas reach a mix together: nothing is turned away
    assert not collective.holding


def test_without_validation_requests_are_neither_checked_nor_timed():
    run = small_run("validation.enabled=false")
    body = Worker(run, 1)
    nan = call(body, "forward", samples(1), torch.full((1, 16, run.model.ssn.rank), float("nan")))
    assert not nan["wire"].isfinite().all()  # computed: nothing refused it
    assert body.stats.refused == 0 and body.stats.checks_s == 0.0
