"""A self-fed whole-model replica's feeder (agoractl.training.self_feed) driving a real Worker on the session's real
shards, without networking: the replica of rank r trains exactly block r of every global batch of the run's sample
stream (what ``launch central`` and ``agoractl simulate`` read), from the batch of the step it starts at; its loss
per step counts exactly its share; its own samples queue through a blocking mix; the data running out ends it and
says so. The swarm that runs it over the network is tests/runtime/test_fgdiloco_worker.py's.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from agoractl.data.stream import run_sequences
from agoractl.manifest.loader import load_manifest
from agoractl.training.self_feed import SelfFeed, replica_rank
from agoractl.training.central import batches
from agoractl.training.worker import Task, Worker
from tests.conftest import MANIFESTS, private_shards


@pytest.fixture
def run(sample_shards, tmp_path):
    return load_manifest(MANIFESTS / "fgdiloco-dp-cpu.yaml", [*private_shards(sample_shards, tmp_path),
                                                              "training.max_steps=4", "model.seq_len=32"])


def feed_until_done(run, peer: str, ids: list[str], step: int = 0, shorten: int | None = None):
    """A worker and its feeder, the worker's compute loop run here until the feeder ended and the worker took its
    last step (as a worker process does); returns (worker, feeder, the ids of every batch submitted)."""
    worker = Worker(run, 0, step=step)
    submitted: list[torch.Tensor] = []
    submit = worker.submit
    worker.submit = lambda task: (submitted.append(task.ids.clone()), submit(task))[1]
    feed = SelfFeed(run, worker, peer, lambda: ids, threading.Event())
    if shorten is not None:  # the data runs out after `shorten` batches
        real = feed._batches
        feed._batches = lambda first: itertools.islice(real(first), shorten)
    feed.start()
    deadline = time.monotonic() + 120
    while not (feed.ended.is_set() and not worker.queued()
               and (worker.progress.finished or not worker.progress.should_step())):
        worker.run_once(0.05)
        assert time.monotonic() < deadline, "the feeder did not end"
    feed.join(5)
    return worker, feed, submitted


def global_batches(run, n: int) -> list[torch.Tensor]:
    return list(itertools.islice(batches(run_sequences(run), run.training.global_batch_size), n))


def test_ranks_are_places_among_the_sorted_peer_ids_mod_m():
    assert [replica_rank(p, ["c", "a", "b"], 3) for p in "abc"] == [0, 1, 2]
    assert replica_rank("a", ["b"], 2) == 0  # itself counted before its own record propagates
    assert replica_rank("c", ["a", "b", "c"], 2) == 0  # more live than M (a departed record lingers): mod M


def test_a_replica_trains_its_block_of_every_global_batch_and_counts_its_loss_per_step(run):
    worker, feed, submitted = feed_until_done(run, "peer-b", ["peer-a", "peer-b"])
    expected = [b[4:8] for b in global_batches(run, 4)]  # rank 1 of 2: samples 4-7 of each batch of 8
    assert len(submitted) == 4 and all(torch.equal(s, e) for s, e in zip(submitted, expected))
    assert worker.progress.step == 4 and worker.stats.backward_samples == 16
    stats = feed.summary()
    assert stats["trainer"] == 1 and stats["kind"] == "self-feed"
    assert {int(k): v[1] for k, v in stats["loss"].items()} == {0: 4, 1: 4, 2: 4, 3: 4}
    assert all(v[0] / v[1] > 0 for v in stats["loss"].values())
    assert (stats["dispatched"], stats["completed"], stats["lost"]) == (16, 16, 0)
    assert stats["finished_reason"] == "max_steps reached" and stats["first_dispatch"] is not None


def test_a_replica_starting_at_step_k_reads_on_from_batch_k(run):
    _, feed, submitted = feed_until_done(run, "peer-a", ["peer-b", "peer-a"], step=2)
    expected = [b[0:4] for b in global_batches(run, 4)[2:]]  # rank 0
    assert len(submitted) == 2 and all(torch.equal(s, e) for s, e in zip(submitted, expected))
    assert sorted(int(k) for k in feed.summary()["loss"]) == [2, 3]


def test_the_data_running_out_ends_the_feeder_and_says_at_which_step(run):
    worker, feed, submitted = feed_until_done(run, "peer-a", ["peer-a", "peer-b"], shorten=2)
    assert len(submitted) == 2 and worker.progress.step == 2
    assert feed.exhausted and feed.summary()["finished_reason"] == "data exhausted at step 2"


def test_own_samples_queue_through_a_blocking_mix_others_are_answered_waiting(run):
    worker = Worker(run, 0)
    answers: list = []
    ids = global_batches(run, 1)[0][:4]
    worker.submit(Task("forward_backward", ids, None, None, lambda r, e: answers.append(("early", r))))
    worker.hold(True)  # queued requests are answered at once, but not the replica's own
    assert answers == [("early", {"waiting": True, "step": 0})]
    answers.clear()
    worker.submit(Task("forward_backward", ids, None, None, lambda r, e: answers.append(("own", r)), own=True))
    worker.submit(Task("forward_backward", ids, None, None, lambda r, e: answers.append(("trainer", r))))
    assert worker.queued() == 1 and answers == [("trainer", {"waiting": True, "step": 0})]
    worker.hold(False)
    assert worker.run_once(0) and answers[1][0] == "own" and answers[1][1]["loss"].numel() == 4


def test_data_that_cannot_be_read_ends_the_feeder_with_the_reason(run, tmp_path):
    broken = run.model_copy(update={"data": run.data.model_copy(update={"output": str(tmp_path / "nothing")})})
    feed = SelfFeed(broken, Worker(broken, 0), "peer-a", lambda: ["peer-a", "peer-b"], threading.Event())
    feed.start()
    assert feed.ended.wait(60)
    assert feed.failure is not None and "nothing" in feed.failure, feed.failure
    assert feed.summary()["finished_reason"].startswith("feeding failed:")
