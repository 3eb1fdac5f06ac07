"""The worker's activation cache (agoractl.training.activation_cache): a pure pipeline of in-process
workers trains to the same losses with it on and off, evictions and backwards landing on another
replica fall back to the recompute and still complete every sample, and the cache's accounting, and the
process's memory, stay within workers.activation_cache_mb (a dropped entry frees its graph)."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from agoractl.training.activation_cache import ActivationCache, Entry
from agoractl.training.worker import Worker
from agoractl.manifest.loader import load_manifest
from tests.conftest import MANIFESTS
from tests.training.test_worker import samples, small_run, submit

STEPS = 20


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one torch thread is fastest, and steadier on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stateless() -> tuple[list, list]:
    """The cache-off run every cache-on run must match."""
    return pipeline(0)


def drain(w: Worker, boxes) -> list[dict]:
    while not all(b.done for b in boxes):
        w.run_once(0.01)
    for b in boxes:
        if b.error is not None:
            raise b.error
    return [b.result for b in boxes]


def pipeline(cache_mb: float, steps: int = STEPS, evict_at: int = -1) -> tuple[list, list]:
    """Train `steps` steps of 4 samples, sent as 2 requests of 2 that each worker coalesces: the losses per
    request and the workers. `evict_at`: the step at which every cache is emptied between forward and
    backward."""
    run = small_run(f"workers.activation_cache_mb={cache_mb}", f"training.max_steps={steps}")
    head, body, tail = Worker(run, 0), Worker(run, 1), Worker(run, 2)
    data = samples(4 * steps, seed=3)
    losses = []
    for step in range(steps):
        reqs = list(data[4 * step:4 * step + 4].split(2))
        w1 = [r["wire"] for r in drain(head, [submit(head, "forward", ids) for ids in reqs])]
        w2 = [r["wire"] for r in drain(body, [submit(body, "forward", ids, w) for ids, w in zip(reqs, w1)])]
        outs = drain(tail, [submit(tail, "forward_backward", ids, w) for ids, w in zip(reqs, w2)])
        losses += [o["loss"].tolist() for o in outs]
        if step == evict_at:
            for w in (head, body):
                w.cache.clear()
        g1 = [r["grad"] for r in drain(body, [submit(body, "backward", ids, w, o["grad"])
                                              for ids, w, o in zip(reqs, w1, outs)])]
        assert all(g.shape == w.shape for g, w in zip(g1, w1))
        drain(head, [submit(head, "backward", ids, None, g) for ids, g in zip(reqs, g1)])
        for w in (head, body, tail):
            w.maybe_step()
    return losses, [head, body, tail]


def assert_same_losses(a: list, b: list) -> None:
    assert len(a) == len(b) == 2 * STEPS
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6)


def test_cache_on_and_off_train_to_the_same_losses_and_the_cache_serves_the_backwards(stateless):
    off, workers_off = stateless
    on, workers_on = pipeline(64)
    assert_same_losses(off, on)
    head, body = workers_on[0], workers_on[1]
    assert workers_off[0].cache is None and workers_on[2].cache is None  # the tail fuses its own backward
    for w in (head, body):
        assert w.progress.step == STEPS
        assert w.cache.stats.hits == 2 * STEPS and w.cache.stats.misses == 0, w.cache.summary()
        assert len(w.cache) == 0  # every entry left with its backward
    for a, b in zip(workers_off, workers_on):
        for p, q in zip(a.params, b.params):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_evicted_mid_run_every_sample_still_completes_by_the_recompute(stateless):
    off, _ = stateless
    on, workers = pipeline(64, evict_at=STEPS // 2)
    assert_same_losses(off, on)
    head = workers[0]
    assert head.cache.stats.misses == 2 and head.cache.stats.hits == 2 * (STEPS - 1)
    assert head.stats.backward_samples == 4 * STEPS


def test_a_bound_smaller_than_one_forward_keeps_nothing_and_still_trains_alike(stateless):
    off, _ = stateless
    on, workers = pipeline(0.001)  # 1 KiB: no forward graph fits
    assert_same_losses(off, on)
    assert workers[1].cache.stats.hits == 0 and workers[1].cache.stats.peak_bytes == 0
    assert workers[1].cache.stats.evicted == STEPS  # one entry per coalesced forward, none kept


def test_a_backward_on_another_replica_recomputes_there_to_the_same_gradients():
    run = small_run("workers.activation_cache_mb=64")
    pinned, other = Worker(run, 0), Worker(run, 0)  # same seed: the same weights
    ids, grad = samples(2), torch.randn(2, 16, run.model.ssn.rank)
    drain(pinned, [submit(pinned, "forward", ids)])
    drain(other, [submit(other, "backward", ids, None, grad)])  # the forward ran elsewhere
    drain(pinned, [submit(pinned, "backward", ids, None, grad)])
    assert other.cache.stats.misses == 1 and other.cache.stats.hits == 0
    assert pinned.cache.stats.hits == 1 and pinned.cache.stats.misses == 0
    for p, q in zip(pinned.params, other.params):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)


def test_stale_weights_are_never_used():
    run = small_run("workers.activation_cache_mb=64")
    head = Worker(run, 0)
    ids = samples(2)
    drain(head, [submit(head, "forward", ids)])
    with torch.no_grad():
        head.params[0].add_(0.01)  # e.g. an averaging round between forward and backward
    drain(head, [submit(head, "backward", ids, None, torch.randn(2, 16, run.model.ssn.rank))])
    assert head.cache.stats.stale == 1 and head.cache.stats.hits == 0 and head.cache.stats.misses == 1


def graph_tensors(output: torch.Tensor) -> list[weakref.ref]:
    """Weak references to `output` and to every tensor autograd saved in its graph."""
    refs, todo, seen = [weakref.ref(output)], [output.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        saved = (getattr(node, a) for a in dir(node) if a.startswith("_saved_"))
        refs += [weakref.ref(t) for t in saved if isinstance(t, torch.Tensor)]
        todo += [n for n, _ in node.next_functions]
    return refs


def test_an_entry_dropped_without_its_backward_frees_its_graph():
    """A stale or evicted entry is dropped unused: its graph, and every activation it saved, must go with it
    (saving a tensor that holds its own graph node made a cycle nothing freed: the head's RSS grew by the
    graph of every stale forward, to 2.6 GB on bench-cpu)."""
    run = small_run("workers.activation_cache_mb=64")
    for w, wire in ((Worker(run, 0), None), (Worker(run, 1), torch.randn(2, 16, run.model.ssn.rank))):
        drain(w, [submit(w, "forward", samples(2), wire)])
        refs = [r for entry in w.cache.entries.values() for r in graph_tensors(entry.output)]
        assert len(refs) > 3
        w.cache.clear()
        gc.collect()
        assert [r for r in refs if r() is not None] == [], f"{w.name}: the dropped entry's tensors are alive"


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_the_process_memory_stays_within_the_bound_as_entries_go_stale_and_are_evicted():
    """What workers.activation_cache_mb bounds is the worker's memory, not only the cache's own count: a
    bench-cpu head (entries of about 20 MB) stores 40 forward batches under a 64 MB bound, a step dropping
    them all every fifth one; the process's RSS grows by no more than the bound."""
    run = load_manifest(MANIFESTS / "bench-cpu.yaml", ["workers.activation_cache_mb=64"])
    head = Worker(run, 0)

    def forward(seed: int) -> None:
        drain(head, [submit(head, "forward", samples(8, run.model.seq_len, seed=seed))])

    for seed in range(6):  # the allocator's and torch's own first-use memory
        forward(seed)
    head.cache.clear()
    gc.collect()
    before = peak = rss_mb()
    for seed in range(40):
        forward(100 + seed)
        if seed % 5 == 4:  # a step: every entry is stale, and dropped unused
            head.cache.clear()
        peak = max(peak, rss_mb())
    assert head.cache.stats.evicted > 0  # the bound was reached too
    assert peak - before <= 64, f"RSS grew {peak - before:.0f} MB under a 64 MB cache bound"


def test_the_accounting_stays_within_the_bound_and_counts_the_saved_activations():
    run = small_run("workers.activation_cache_mb=64")
    body = Worker(run, 1)
    wire = torch.randn(2, 16, run.model.ssn.rank)
    drain(body, [submit(body, "forward", samples(2), wire)])
    one = body.cache.used
    # At least the stage's input, output and a hidden state per layer per sample are kept alive.
    hidden = 2 * 16 * run.model.d_model * 4
    assert one >= wire.numel() * 4 + hidden * (1 + run.stages[1].layers)
    body.cache.limit = int(2.5 * one)  # room for two entries, not three
    for seed in range(10):
        drain(body, [submit(body, "forward", samples(2, seed=seed + 1), wire)])
        assert body.cache.used <= body.cache.limit
    assert len(body.cache) == 2 and body.cache.stats.evicted == 9
    assert body.cache.stats.peak_bytes <= body.cache.limit


def test_an_entry_serves_each_of_its_requests_once_and_leaves_with_the_last():
    cache = ActivationCache(1 << 20)
    out = torch.zeros(3, 1)
    cache.store(Entry([b"a", b"b", b"c"], [1, 1, 1], out, None, 0, 100))
    cache.store(Entry([b"d"], [1], out[:1], None, 0, 100))
    hits, misses = cache.take([b"d", b"c", b"x"], 0)
    assert [(e.keys, slots) for e, slots in hits] == [([b"d"], [0]), ([b"a", b"b", b"c"], [None, None, 1])]
    assert misses == [2] and len(cache) == 1 and cache.samples() == 2  # a, b still to come
    hits, misses = cache.take([b"c", b"b", b"a"], 0)  # c was served already: it recomputes
    assert [slots for _, slots in hits] == [[2, 1, None]] and misses == [0]
    assert len(cache) == 0 and cache.used == 0 and cache.stats.hits == 4 and cache.stats.misses == 2
    cache.store(Entry([b"a", b"a"], [1, 1], out[:2], None, 0, 100))  # the same sample twice
    hits, misses = cache.take([b"a", b"a"], 0)
    assert [slots for _, slots in hits] == [[0, 1]] and misses == []
    cache.store(Entry([b"e", b"f"], [1, 1], out[:2], None, 0, 100))
    hits, misses = cache.take([b"e"], 1)  # other weights: dropped unused, the rest too
    assert hits == [] and misses == [0] and len(cache) == 0 and cache.stats.stale == 1


def test_requests_coalesced_into_one_forward_back_in_separate_backwards_run_on_its_graph_exactly():
    """Two requests forwarded as one batch come back one at a time: each runs the backward through the shared
    graph (zero gradient on the other's rows), and gradients and input gradients match the recompute's."""
    grads = {}
    for cache_mb in (0, 64):
        run = small_run(f"workers.activation_cache_mb={cache_mb}")
        body = Worker(run, 1)
        reqs = list(samples(4, seed=5).split(2))
        wires = [torch.randn(2, 16, run.model.ssn.rank, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
        outs = drain(body, [submit(body, "forward", ids, w) for ids, w in zip(reqs, wires)])  # one pass of 4
        back = [drain(body, [submit(body, "backward", ids, w, o["wire"] * 0.1)])[0]["grad"]  # one at a time
                for ids, w, o in zip(reqs, wires, outs)]
        grads[cache_mb] = (back, [p.grad.clone() for p in body.params])
        if cache_mb:
            assert body.stats.batches["forward"] == 1 and body.cache.stats.hits == 2 and body.cache.stats.misses == 0
            assert len(body.cache) == 0  # left with its last request
    for a, b in zip(grads[0][0] + grads[0][1], grads[64][0] + grads[64][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_forward_of_the_next_steps_batch_waits_for_the_step_and_its_backward_then_hits():
    run = small_run("workers.activation_cache_mb=64", "workers.forward_hold_s=30")  # batch 4
    head = Worker(run, 0)
    now, later = samples(4, seed=1).split(2), samples(2, seed=2)
    wires = [r["wire"] for r in drain(head, [submit(head, "forward", ids) for ids in now])]
    assert head.cache.samples() == 4  # the rest of the step's batch is forwarded already
    early = submit(head, "forward", later)
    for _ in range(5):
        head.run_once(0.01)
    assert not early.done and head.stats.forward_samples == 4  # held: computed now, its graph would go stale
    grads = [torch.randn_like(w) for w in wires]
    boxes = [submit(head, "backward", ids, None, g) for ids, g in zip(now, grads)]
    drain(head, boxes + [early])  # the backwards complete the batch, the step comes, then the forward
    assert head.progress.step == 1 and head.stats.forward_samples == 6
    drain(head, [submit(head, "backward", later, None, torch.randn_like(early.result["wire"]))])
    assert head.cache.stats.misses == 0 and head.cache.stats.hits == 3  # requests; its graph: the new weights


def test_a_replica_holds_the_next_steps_forwards_once_its_share_of_the_missing_samples_is_in_its_cache():
    """With a peer that ran as many samples, a replica's cached forwards are about half the stage's in flight:
    it holds a forward once the samples the step still misses, times its share, are in its cache (alone it
    waited for all of them, so nearly every forward of the next step ran early and took the recompute)."""
    from agoractl.algorithms.progress import PeerProgress

    run = small_run("workers.activation_cache_mb=64", "workers.forward_hold_s=30")  # batch 4
    head = Worker(run, 0)
    first, now, later = samples(2, seed=1), samples(2, seed=2), samples(2, seed=3)
    wire = drain(head, [submit(head, "forward", first)])[0]["wire"]
    drain(head, [submit(head, "backward", first, None, torch.randn_like(wire))])
    head.progress.observe({"peer": PeerProgress(0, 2)})  # the peer ran the other half of step 0's batch
    head.run_once(0.01)
    assert head.progress.step == 1 and head.progress.own_share() == 0.5
    wire = drain(head, [submit(head, "forward", now)])[0]["wire"]
    assert head.progress.room() == 4 and head.cache.samples() == 2  # alone it would not hold: 4 > 2
    early = submit(head, "forward", later)
    for _ in range(5):
        head.run_once(0.01)
    assert not early.done and head.stats.forward_samples == 4  # held
    drain(head, [submit(head, "backward", now, None, torch.randn_like(wire))])
    head.progress.observe({"peer": PeerProgress(1, 4)})  # the peer's half of step 1
    drain(head, [early])  # the step, then the forward, under the new weights
    assert head.progress.step == 2 and head.stats.forward_samples == 6
    drain(head, [submit(head, "backward", later, None, torch.randn_like(early.result["wire"]))])
    assert head.cache.stats.misses == 0 and head.cache.stats.hits == 3


@pytest.mark.parametrize("hold_s", [0.0, 0.3])
def test_the_hold_is_bounded_a_forward_whose_batch_never_completes_still_runs(hold_s):
    """The backwards of the step's batch may never come (a sample lost downstream): the forward waits at
    most workers.forward_hold_s (0: never)."""
    run = small_run("workers.activation_cache_mb=64", f"workers.forward_hold_s={hold_s}")
    head = Worker(run, 0)
    drain(head, [submit(head, "forward", ids) for ids in samples(4, seed=1).split(2)])
    t0 = time.monotonic()
    drain(head, [submit(head, "forward", samples(2, seed=2))])
    waited = time.monotonic() - t0
    assert hold_s <= waited < hold_s + 1.0 and head.progress.step == 0
