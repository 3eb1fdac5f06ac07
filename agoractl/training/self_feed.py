"""A whole-model replica that reads its own samples (``workers.self_feed``): the feeder thread of a worker process,
in place of trainers. Seed 002's replicas each train on their own data; with the model not split, a trainer only
moves samples to a replica and its loss back, so the feeder does that in the replica's own process, without a
request over the network (no serialization, no p2pd hops, no trainer process on the replicas' cores).

- **Rank.** The replica waits until the stage has ``data_parallel.fgdiloco.replicas`` (M) live replicas in the DHT
  (at most ``network.startup_timeout_s``), and takes its place r among their sorted peer ids (mod M, should more
  be live: a replacement while a departed replica's record lingers). Every replica reads the same records, so
  they pick distinct ranks; ranks from different views would only repeat some samples, never stall a step.
- **Data.** The run's sample stream as ``launch central`` reads it (:func:`agoractl.data.stream.run_sequences`), cut
  into global batches: step s trains batch s, the replica of rank r its block r (samples ``r * share`` to
  ``(r + 1) * share``, share = the global batch / M). That is the split of ``agoractl simulate`` and of trainers
  routing by :class:`~agoractl.algorithms.routing.ReplicaRoute`, so losses compare step by step. A replica that
  starts at step k (a resume, a joiner) reads on from batch k: the samples of a step are fixed by the step, so a
  restart neither skips nor repeats any.
- **Pipelining.** One batch waits in the worker's queue while the worker computes the previous one (a
  :class:`~agoractl.training.worker.Task` marked ``own``: it stays queued through a blocking mix), and the feeder
  draws the next batch meanwhile: the replica never waits for its feeder.
- **Statistics.** A trainer's (:class:`~agoractl.training.node_stats.TrainerNodeStats`, kind ``self-feed``: first
  dispatch, the loss per step, samples dispatched, completed and lost), in the worker's final stats under
  ``feed``, so the swarm report counts the replicas' losses and training window as it counts trainers'.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

import torch

from agoractl import logs
from agoractl.manifest.schema import Run
from agoractl.training.node_stats import FINISHED_REASONS, TrainerNodeStats
from agoractl.training.worker import Task, Worker

QUEUED_AHEAD = 1
"""Batches waiting in the worker's queue beyond the one it computes."""
RANK_POLL_S = 0.05
"""Seconds between reads of the stage's live replicas while fewer than M are seen (start-up only: the replicas
start feeding within about this much of each other, and a round's mix waits for the later one)."""


def replica_rank(peer: str, live_ids: list[str], replicas: int) -> int:
    """This replica's block of every global batch: its place among the live replicas' sorted peer ids, mod M."""
    ids = sorted(set(live_ids) | {peer})
    return ids.index(peer) % replicas


class SelfFeed:
    """The feeder of one self-fed replica. `live_ids()` lists the stage's live replicas (this one included);
    :meth:`start` it once the worker computes; :attr:`ended` is set when it has nothing more to feed."""

    def __init__(self, run: Run, worker: Worker, peer: str, live_ids: Callable[[], list[str]],
                 stop: threading.Event):
        self.run, self.worker, self.peer, self.live_ids, self.stop = run, worker, peer, live_ids, stop
        self.replicas = int(run.data_parallel.fgdiloco.replicas)
        self.share = int(run.replica_batch)
        self.rank: Optional[int] = None
        self.ended = threading.Event()
        self.exhausted = False
        """The data ran out before ``training.stop_step``."""
        self.failure: Optional[str] = None
        """Why the feeder could not read the data, if it could not (the worker then exits with a failure)."""
        self.stats = TrainerNodeStats(peer=peer, kind="self-feed")
        self.log = logs.get("self-feed")
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="self-feed", daemon=True)
        self._thread.start()

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def summary(self) -> dict:
        """The feeder's statistics, as a trainer writes its own (``feed`` in the worker's final stats); call once
        the worker stopped computing (the reason it finished depends on the step it reached)."""
        if not self.stats.finished_reason:
            done = self.worker.progress.step
            if done >= self.run.training.stop_step:
                self.stats.finished_reason = FINISHED_REASONS[self.run.training.until_step is not None]
            elif self.exhausted:
                self.stats.finished_reason = f"data exhausted at step {done}"
        return self.stats.to_dict()

    # -- the feeder thread --------------------------------------------------------------------

    def _wait_rank(self) -> int:
        deadline = time.monotonic() + self.run.network.startup_timeout_s
        ids = self.live_ids()
        while len(ids) < self.replicas and time.monotonic() < deadline and not self.stop.is_set():
            self.stop.wait(RANK_POLL_S)
            ids = self.live_ids()
        if len(ids) < self.replicas:
            self.log.warning("fewer live replicas than data_parallel.fgdiloco.replicas: ranked among those seen",
                             live=len(ids), replicas=self.replicas)
        return replica_rank(self.peer, ids, self.replicas)

    def _batches(self, first_step: int):
        """(step, this replica's block) from `first_step` on; ends with the data."""
        from agoractl.data.stream import run_sequences
        from agoractl.training.central import batches

        stream = batches(run_sequences(self.run), self.run.training.global_batch_size)
        lo = self.rank * self.share
        for step, batch in enumerate(itertools.islice(stream, first_step, None), start=first_step):
            yield step, batch[lo:lo + self.share].contiguous()

    def _submit(self, ids: torch.Tensor) -> Future:
        future: Future = Future()

        def done(result, error):
            future.set_exception(error) if error is not None else future.set_result(result)

        self.worker.submit(Task("forward_backward", ids, None, None, done, own=True))
        self.stats.dispatched += int(ids.shape[0])
        return future

    def _settle(self, future: Future, size: int) -> bool:
        """Take the answer of a submitted batch; False once the worker will train no more."""
        try:
            result = future.result()
        except Exception as e:  # the worker is shutting down
            self.stats.lost += size
            self.log.info("batch not trained", error=f"{type(e).__name__}: {e}")
            return False
        if result.get("finished") or result.get("waiting"):  # answered untrained (its last step was taken)
            self.stats.lost += size
            return not result.get("finished")
        losses = result["loss"]
        entry = self.stats.loss.setdefault(int(result["step"]), [0.0, 0])
        entry[0] += float(losses.sum())
        entry[1] += int(losses.numel())
        self.stats.loss_sum += float(losses.sum())
        self.stats.loss_samples += int(losses.numel())
        self.stats.completed += size
        self.stats.last_completion = time.time()
        return True

    def _run(self) -> None:
        try:
            self.rank = self.stats.trainer = self._wait_rank()
            first = self.worker.progress.step
            self.log.info("feeding", rank=self.rank, replicas=self.replicas, share=self.share, step=first)
            pending: collections.deque = collections.deque()
            draws = self._batches(first)
            exhausted, drawing, training = False, True, True
            while training and not self.stop.is_set():
                while len(pending) <= QUEUED_AHEAD and drawing:
                    step, ids = next(draws, (None, None))
                    if step is None or step >= self.run.training.stop_step:  # the data's end, or the run's
                        exhausted, drawing = step is None, False
                        break
                    self.stats.first_dispatch = self.stats.first_dispatch or time.time()
                    pending.append((self._submit(ids), int(ids.shape[0])))
                if not pending:
                    break
                training = self._settle(*pending.popleft())
            self.exhausted = exhausted
        except Exception as e:  # the data cannot be read: the replica ends, and says why
            self.failure = f"{type(e).__name__}: {e}"
            self.stats.finished_reason = f"feeding failed: {self.failure}"
            self.log.error("feeding failed", error=self.failure)
        finally:
            self.ended.set()
