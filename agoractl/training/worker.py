"""A worker's compute: one replica of one stage (report §3.3.1, DESIGN §4).

Requests land on a forward or a backward queue; the compute loop serves the queue holding the
oldest request and **coalesces** the queued requests of that kind (and shape) up to
``workers.max_microbatch`` samples, runs them as one batch and splits the results back (§3.3.1.3).
The stateless path (§3.3.1.4): a backward recomputes the stage's forward to rebuild the autograd graph.
With ``workers.activation_cache_mb`` > 0 the worker keeps its recent forwards' graphs
(:mod:`agoractl.training.activation_cache`, bounded, oldest evicted) and a backward of the same samples
uses them instead; evicted, stale or unknown samples take the recompute. A forward that would be the next
step's (the replica holds forwards for its share of the rest of the current batch already) waits for the step,
at most ``workers.forward_hold_s``, rather than keep a graph the step makes stale. The tail's fused
``forward_backward`` computes forward, loss and backward in one pass and saves that recompute.
A stage of role ``whole`` (the model not split) answers only ``forward_backward``: token ids in,
per-sample losses out, no wire and no input gradient.

Parameter gradients accumulate (each sample's loss unscaled) until the stage has **collectively**
seen ``training.global_batch_size`` samples (:class:`~agoractl.algorithms.progress.StageProgress`, fed
from the DHT by the node); then the replica divides by the samples it accumulated (the mean gradient
of its share of the batch — the whole batch's mean in a pure pipeline), clips stage-wise to
``run.clip_threshold(stage)`` (report §4.3), sets the learning rate of the manifest's schedule and
steps its own AdamW. A whole-model FGDiLoCo replica with ``data_parallel.fgdiloco.replicas`` = M steps on its
own count instead, every global_batch_size / M samples (seed 002's inner steps); once past its last step, or
while it waits in a blocking mix, it answers requests at once, untrained (:meth:`Worker.hold`), so that the
trainers feed its peers. Master weights and AdamW moments stay on the CPU (§3.3.1); with a CUDA device
the stage computes there and the gradients are copied to the masters at step time.

Hooks for the layers built on top (SPARTA averaging, sync phases, self-termination):
``step_callbacks`` run after every optimizer step with ``(step, worker)``; ``listeners`` receive
structured events (``{"event": ..., ...}``; never log text); ``phase`` and ``role`` are announced.
No networking here: :mod:`agoractl.runtime.worker_node` connects this to the DHT and libp2p.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.nn import functional as F

from agoractl.manifest.schema import Run
from agoractl.model.codec import from_wire, to_wire
from agoractl.model.build import build_stage
from agoractl.algorithms.optim import lr_at, make_optimizer, optimizer_step
from agoractl.algorithms.progress import StageProgress
from agoractl.algorithms.validation import inputs_problem, request_problem
from agoractl.training.activation_cache import ActivationCache, Entry, SavedBytes, param_version, request_key
from agoractl.training.fault_drill import corrupt_results
from agoractl.training.node_stats import WorkerStats

QUEUE_OF = {"forward": "forward", "backward": "backward", "forward_backward": "backward"}
"""Which queue each method lands on: everything that accumulates gradients is a backward."""


@dataclass
class Task:
    """One request: `ids` [b, seq_len+1] token ids; `wire` the stage input (None at the head);
    `grad` the gradient of the stage output (backward only). `done(result, error)` is called once,
    from the compute thread."""

    method: str
    ids: torch.Tensor
    wire: Optional[torch.Tensor]
    grad: Optional[torch.Tensor]
    done: Callable[[Optional[dict], Optional[BaseException]], None]
    arrived: float = field(default_factory=time.monotonic)
    refused: Optional[str] = None
    """Why the worker refused it (answered already), once it did."""
    own: bool = False
    """The replica's own sample (``workers.self_feed``): no peer needs it, so it queues through a blocking mix."""

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def key(self) -> tuple:
        """Requests coalesce only with the same method and shapes."""
        return (self.method, tuple(self.ids.shape[1:]), None if self.wire is None else tuple(self.wire.shape[1:]))


class Worker:
    """One stage replica's queues, compute loop, gradient accumulation and optimizer."""

    def __init__(self, run: Run, stage_index: int, device: str = "cpu", step: int = 0,
                 phase: str = "active", role: str = "operator", restarts: bool = False,
                 seen: Optional[int] = None):
        self.run, self.index = run, stage_index
        self.name = run.stage_names()[stage_index]
        self.device = torch.device(device)
        self.module = build_stage(run, stage_index, self.device)
        self.module.train()
        self.role_in_pipeline = self.module.role  # head / body / tail, or whole (the model not split)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        if self.device.type == "cpu":
            self.master = self.params
        else:  # master weights and moments on the CPU; the device holds a compute copy
            self.master = [p.detach().to("cpu", copy=True).requires_grad_(True) for p in self.params]
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._optimizer_lock = threading.Lock()
        own = run.replica_batch  # FGDiLoCo with M set: a replica's inner steps are its own (seed 002)
        self.progress = StageProgress(own or run.training.global_batch_size, run.training.stop_step, step,
                                      restarts, seen, own=own is not None)
        self.max_microbatch = run.workers.max_microbatch
        self.forward_hold_s = run.workers.forward_hold_s
        self.wire_dtype = run.workers.wire_dtype
        self.phase, self.role = phase, role
        self.averaging_round: Optional[int] = None
        """The SPARTA round this replica is averaging right now, announced in its record (set by the rounds)."""
        self.validate = run.validation.enabled
        self.fault: Optional[str] = None
        """A fault drill (:mod:`agoractl.training.fault_drill`): this worker's outputs are made wrong on purpose."""
        self.stats = WorkerStats()
        cache_mb = run.workers.activation_cache_mb
        self.cache: Optional[ActivationCache] = (
            ActivationCache(int(cache_mb * 2**20)) if cache_mb > 0 and self.role_in_pipeline != "tail" else None)
        """Forward graphs kept for the backward (None: the stateless recompute; the tail never needs it)."""
        self.throughput = 0.0
        """Samples per second of compute (exponential moving average)."""
        self.step_callbacks: list[Callable[[int, "Worker"], None]] = []
        self.listeners: list[Callable[[dict], None]] = []
        self.events: collections.deque = collections.deque(maxlen=256)
        self._queues: dict[str, collections.deque] = {"forward": collections.deque(), "backward": collections.deque()}
        self._cond = threading.Condition()
        self._closed: Optional[BaseException] = None
        self.holding = False
        """In a blocking mix, stepping on its own count: requests are answered "waiting" (:meth:`hold`)."""
        self.progress_changed = threading.Event()
        """Set whenever the local (step, samples) changes, so the node publishes it."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The stage's AdamW, built on first use: torch's optimizer imports torch._dynamo (about half of a
        worker's start-up CPU), so a node builds it after it is ready (:meth:`build_optimizer` at its first
        idle moment, in the thread that computes) rather than before it can serve its first forward."""
        if self._optimizer is None:
            with self._optimizer_lock:
                if self._optimizer is None:
                    self._optimizer = make_optimizer(self.master, self.run)
        return self._optimizer

    def build_optimizer(self) -> None:
        """Build the optimizer now (a node calls this once it serves and has nothing queued)."""
        self.optimizer

    # -- events -------------------------------------------------------------------------------

    def emit(self, event: str, **fields) -> None:
        record = {"event": event, "time": time.time(), "stage": self.name, **fields}  # fields may set time
        self.events.append(record)
        for listener in list(self.listeners):
            listener(record)

    # -- queues -------------------------------------------------------------------------------

    def submit(self, task: Task) -> None:
        """Queue a request (thread-safe); the compute loop answers through `task.done`."""
        if task.method not in QUEUE_OF:
            task.done(None, ValueError(f"unknown method {task.method!r}"))
            return
        if task.method == "forward_backward" and not self.module.computes_loss:
            task.done(None, ValueError(f"forward_backward is the tail's call; stage {self.name} is the "
                                       f"{self.role_in_pipeline}"))
            return
        if task.method != "forward_backward" and self.module.embeds and self.module.computes_loss:
            task.done(None, ValueError(f"stage {self.name} holds the whole model: it answers forward_backward only"))
            return
        if self.validate:
            t0 = time.thread_time()  # the checks' own CPU time: what validation costs (stats.checks_s)
            problem = request_problem(task.method, task.ids, task.wire, task.grad, self.run.model.vocab_size,
                                      not self.module.embeds, deferred=self.cache is not None)
            self.stats.checks_s += time.thread_time() - t0
            if problem:  # never computed: bad inputs must not reach this stage's gradients
                self._refuse(task, problem)
                return
        with self._cond:
            if self._closed is not None:
                task.done(None, self._closed)
                return
            if self.progress.own and (self.progress.finished or (self.holding and not task.own)):
                self._answer_now(task)
                return
            if self.stats.first_request is None:
                self.stats.first_request = time.time()
            self._queues[QUEUE_OF[task.method]].append(task)
            self._cond.notify()

    def _refuse(self, task: Task, problem: str) -> None:
        task.refused = problem
        self.stats.refused += 1
        self.emit("request_refused", method=task.method, problem=problem)
        task.done(None, ValueError(f"refused: {problem}"))

    def _answer_now(self, task: Task) -> None:
        """A replica stepping on its own count answers at once, untrained, when it took its last step
        ("finished": its peers may still be short of theirs) or while it waits in a blocking mix ("waiting":
        its peers need those samples to reach the mix at all). The trainer sends the sample to another."""
        if self.progress.finished:
            self.stats.finished_replies += 1
            task.done({"finished": True, "step": self.progress.step}, None)
        else:
            self.stats.waiting_replies += 1
            task.done({"waiting": True, "step": self.progress.step}, None)

    def hold(self, on: bool) -> None:
        """Enter (`on`) or leave a blocking mix. Replicas on their own counts reach it one after the other, and
        the first one there must not sit on requests its peers need to get there: in it, queued and new requests
        are answered "waiting" at once (a deadlock otherwise: the trainers' requests queued at the waiting
        replica, the others starved until the mix timed out)."""
        with self._cond:
            self.holding = on and self.progress.own
            if self.holding:
                self._answer_queued()

    def _answer_queued(self) -> None:
        """Answer every queued request at once, untrained (:meth:`_answer_now`), except the replica's own samples
        in a blocking mix (they wait for it to end); call holding ``_cond``."""
        for q in self._queues.values():
            keep = [t for t in q if t.own and not self.progress.finished]
            for t in [t for t in q if not (t.own and not self.progress.finished)]:
                self._answer_now(t)
            q.clear()
            q.extend(keep)

    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def _take(self, stepping: bool = True) -> list[Task]:
        """The batch to compute next: from the queue holding the oldest request, that request and the
        queued ones of the same kind, up to max_microbatch samples — and, for gradient work while the
        stage is short of its batch, no more than the samples the step still needs. Unless `stepping`, no
        gradient work once the batch is complete: it waits for the step."""
        full = not stepping and not self.progress.finished and self.progress.room() == 0
        held = stepping and self._forwards_wait()
        heads = [(q[0].arrived, name) for name, q in self._queues.items()
                 if q and not (full and name == "backward") and not (held and name == "forward")]
        if not heads:
            return []
        _, name = min(heads)
        queue = self._queues[name]
        first = queue.popleft()
        cap = self.max_microbatch
        if name == "backward" and not self.progress.finished and self.progress.room() > 0:
            cap = min(cap, self.progress.room())
        batch, total = [first], first.size
        rest = collections.deque()
        while queue and total < cap:
            t = queue.popleft()
            if t.key() == first.key() and total + t.size <= cap:
                batch.append(t)
                total += t.size
            else:
                rest.append(t)
        queue.extendleft(reversed(rest))
        return batch

    def _forwards_wait(self) -> bool:
        """Whether the queued forwards wait for the step (``workers.forward_hold_s``): the replica's cache
        already holds the forwards of its share of the rest of the current step's batch (their backwards not run
        yet), so a forward now would be the next step's, its cached graph stale before its backward came. Its
        share (:meth:`~agoractl.algorithms.progress.StageProgress.own_share`): the other replicas hold the
        rest in flight; counting the whole rest against its own cache, a replica of two almost never held, and on
        bench-cpu with 2 replicas per stage a third of the head's backwards took the recompute. Never for longer
        than the hold: a sample lost downstream must not keep the forwards waiting."""
        q = self._queues["forward"]
        if self.cache is None or not q or self.progress.finished or self.progress.own:
            return False
        if time.monotonic() - q[0].arrived > self.forward_hold_s:
            return False
        return 0 < self.progress.room() * self.progress.own_share() <= self.cache.samples()

    # -- the loop -----------------------------------------------------------------------------

    def run_once(self, timeout: float = 0.05) -> bool:
        """Step if the stage is due, then compute one coalesced batch; False if none came in `timeout`."""
        self.maybe_step()
        return self.serve_once(timeout)

    def serve_once(self, timeout: float = 0.05, stepping: bool = True) -> bool:
        """Compute one coalesced batch; False if none came in `timeout`. A step callback that waits (a SPARTA
        round for the previous one) calls this with `stepping` False: the trainers' forwards are answered
        meanwhile (report §4.2: the exchange does not stop the worker), and their backwards until the step's
        batch is complete — beyond it they wait for the step, which must not absorb several batches."""
        t0 = time.monotonic()
        with self._cond:
            if not self.queued():
                self._cond.wait(timeout)
            if self.progress.own and self.progress.finished:  # queued while the last step (and its mix) ran
                self._answer_queued()
            batch = self._take(stepping)
            if not batch and self.queued():  # only work held for the step: wait for a new request, do not spin
                self._cond.wait(timeout)
                batch = self._take(stepping)
        self.stats.idle_s += time.monotonic() - t0
        if not batch:
            return False
        self._compute(batch)
        return True

    def run(self, stop: threading.Event) -> None:
        """The compute loop, until `stop` is set; pending requests then fail."""
        while not stop.is_set():
            self.run_once()
        self.fail_pending(RuntimeError(f"worker of stage {self.name} is shutting down"))

    def fail_pending(self, error: BaseException) -> None:
        """Fail every queued request with `error`, and every later one: the worker is closing."""
        with self._cond:
            self._closed = error
            tasks = [t for q in self._queues.values() for t in q]
            for q in self._queues.values():
                q.clear()
        for t in tasks:
            t.done(None, error)

    # -- compute ------------------------------------------------------------------------------

    def _compute(self, batch: list[Task]) -> None:
        method = batch[0].method
        sizes = [t.size for t in batch]
        n = sum(sizes)
        t0, c0 = time.monotonic(), time.thread_time()
        try:
            with torch.enable_grad() if method != "forward" or self.cache is not None else torch.no_grad():
                results = getattr(self, f"_{method}")(batch, sizes)
                if None in results:  # requests refused in compute (a backward's deferred check): answered
                    batch = [t for t, r in zip(batch, results) if r is not None]
                    results, n = [r for r in results if r is not None], sum(t.size for t in batch)
                if self.fault is not None:
                    corrupt_results(self.fault, method, results, self.params, sum(self.stats.batches.values()))
        except Exception as e:  # a bad request or a compute failure: every request of the batch fails
            self.stats.failed_batches += 1
            self.emit("compute_failed", method=method, error=f"{type(e).__name__}: {e}", samples=n)
            if self.device.type == "cuda" and isinstance(e, RuntimeError) and "CUDA" in str(e):
                self.emit("device_error", error=str(e))
            for t in batch:
                if t.refused is None:
                    t.done(None, e)
            return
        elapsed = time.monotonic() - t0
        if not batch:
            return
        self.stats.compute_s += elapsed
        self.stats.compute_cpu_s += time.thread_time() - c0
        self.stats.batches[method] += 1
        self.stats.max_coalesced = max(self.stats.max_coalesced, n)
        self.stats.coalesced_sum += n
        rate = n / max(elapsed, 1e-6)
        self.throughput = rate if self.throughput == 0 else 0.8 * self.throughput + 0.2 * rate
        if self.cache is not None:
            self.stats.cache = self.cache.summary()
        if method == "forward":
            self.stats.forward_samples += n
        else:
            self.stats.backward_samples += n
            self.progress.add(n, report=self.phase == "active")  # sync phases report no samples
            self.progress_changed.set()
        for t, r in zip(batch, results):
            r["step"] = self.progress.step  # the step this work counts toward (the trainer's loss curve)
            t.done(r, None)

    def _inputs(self, batch: list[Task], grad: bool) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        ids = torch.cat([t.ids for t in batch]).to(self.device, dtype=torch.long)
        if ids.dim() != 2:
            raise ValueError(f"ids must be [batch, seq_len+1]; got shape {tuple(ids.shape)}")
        if self.module.embeds:
            return None, ids
        if any(t.wire is None for t in batch):
            raise ValueError(f"stage {self.name} needs the previous stage's wire tensor")
        wire = torch.cat([from_wire(t.wire, self.device) for t in batch])
        if wire.shape[:2] != (ids.shape[0], ids.shape[1] - 1):
            raise ValueError(f"wire shape {tuple(wire.shape)} does not match ids {tuple(ids.shape)}")
        return wire.requires_grad_(grad), ids

    def _split(self, t: Optional[torch.Tensor], sizes: list[int]) -> list[Optional[torch.Tensor]]:
        if t is None:
            return [None] * len(sizes)
        return [to_wire(part, self.wire_dtype) for part in t.split(sizes)]

    def _forward(self, batch: list[Task], sizes: list[int]) -> list[dict]:
        if self.cache is None:
            wire, ids = self._inputs(batch, grad=False)
            out = self.module(wire, ids[:, :-1])
            return [{"wire": w} for w in self._split(out, sizes)]
        wire, ids = self._inputs(batch, grad=True)
        with SavedBytes(self.params) as saved:  # what the graph keeps alive: the cache's accounting
            out = self.module(wire, ids[:, :-1])
        saved.add(wire, out, ids)
        self.cache.store(Entry([request_key(t.ids, t.wire) for t in batch], sizes, out, wire,
                               param_version(self.params), saved.nbytes))
        return [{"wire": w} for w in self._split(out.detach(), sizes)]

    def _backward(self, batch: list[Task], sizes: list[int]) -> list[dict]:
        if self.cache is None:
            hits, misses = [], list(range(len(batch)))
        else:
            hits, misses = self.cache.take([request_key(t.ids, t.wire) for t in batch], param_version(self.params))
        results: list[Optional[dict]] = [{} for _ in batch]
        if self.validate and self.cache is not None and misses:  # the check submit deferred, before the recompute
            refused = [p for p in misses if self._refused_inputs(batch[p])]
            for p in refused:
                results[p] = None
            misses = [p for p in misses if results[p] is not None]
            if not hits and not misses:
                return results
        grads = [from_wire(t.grad, self.device) for t in batch]
        outputs, parts = [], []  # per graph the backward runs through: its stage input, per request of its rows
        # the position in `batch` served now (None: another batch's request, its rows get a zero gradient)
        for entry, slots in hits:
            outputs.append(entry.output)
            parts.append((entry.input, slots, entry.sizes))
        if misses:
            wire, ids = self._inputs([batch[p] for p in misses], grad=True)
            outputs.append(self.module(wire, ids[:, :-1]))  # the recompute: the stateless path
            parts.append((wire, misses, [sizes[p] for p in misses]))
        out_grads = []
        for out, (_, slots, rows) in zip(outputs, parts):
            bad = [tuple(grads[p].shape) for p, n in zip(slots, rows)
                   if p is not None and grads[p].shape != (n, *out.shape[1:])]
            if bad:
                raise ValueError(f"output gradient shapes {bad} do not match the output {tuple(out.shape)}")
            out_grads.append(torch.cat([grads[p] if p is not None else out.new_zeros((n, *out.shape[1:]))
                                        for p, n in zip(slots, rows)]))
        kept = any(not all(entry.served) for entry, _ in hits)  # a graph other requests still need
        torch.autograd.backward(outputs, out_grads, retain_graph=kept)
        for wire, slots, rows in parts:
            if wire is not None:
                for p, g in zip(slots, self._split(wire.grad, rows)):
                    if p is not None:  # a shared graph's rows of other requests hold their own (earlier) grads
                        results[p] = {"grad": g}
        return results

    def _refused_inputs(self, task: Task) -> bool:
        """Refuse `task` (True) if its ids or wire fail the values check its submit deferred."""
        t0 = time.thread_time()
        problem = inputs_problem(task.ids, task.wire, self.run.model.vocab_size, not self.module.embeds)
        self.stats.checks_s += time.thread_time() - t0
        if problem:
            self._refuse(task, problem)
        return bool(problem)

    def _forward_backward(self, batch: list[Task], sizes: list[int]) -> list[dict]:
        wire, ids = self._inputs(batch, grad=True)
        logits = self.module(wire, ids[:, :-1])
        labels = ids[:, 1:]
        losses = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                 reduction="none").view(labels.shape).mean(dim=1)
        losses.sum().backward()  # each sample's mean loss, unscaled: the step divides by the count
        grads = self._split(None if wire is None else wire.grad, sizes)  # whole: no input wire, no gradient
        per_sample = losses.detach().cpu().split(sizes)
        return [{"loss": l, **({"grad": g} if g is not None else {})} for g, l in zip(grads, per_sample)]

    # -- stepping -----------------------------------------------------------------------------

    def maybe_step(self) -> bool:
        """Take the optimizer step if the stage collectively completed its batch (or a peer did)."""
        if not self.progress.should_step():
            return False
        self.step()
        return True

    @torch.no_grad()
    def step(self) -> None:
        """Mean of the accumulated gradients, stage-wise clipping, AdamW at the schedule's rate."""
        step = self.progress.step
        contributed = self.progress.samples
        norm = 0.0
        if contributed > 0 and any(p.grad is not None for p in self.params):
            result = optimizer_step(self.optimizer, [(self.params, self.run.clip_threshold(self.index))],
                                    lr_at(self.run, step), samples=contributed,
                                    master=None if self.master is self.params else self.master)
            norm = result.norms[0]
            self.emit("gradients", finite=result.stepped, step=step, grad_norm=norm)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            for p in self.params:
                p.grad = None
        if self.cache is not None:
            self.cache.clear()  # every kept graph is of the old weights now
        self.progress.advance()
        self.progress_changed.set()
        self.stats.steps.append([step, time.time(), contributed, norm])
        self.emit("step", step=step, samples=contributed, grad_norm=norm)
        for callback in list(self.step_callbacks):
            callback(step, self)
