"""The in-process simulator's core: replicas trained with the workers' own algorithm code, one process.

Two kinds of simulated run, both on one data stream split across replicas:

- :class:`FGDiLoCoSim` / :func:`run_fgdiloco`: M full-model replicas (:class:`Replica`) under FGDiLoCo. Every
  replica takes inner AdamW steps (the workers' optimizer, schedule and stage-wise clipping from
  :mod:`agoractl.algorithms.optim`); rounds use :mod:`agoractl.algorithms.fgdiloco` (Mix1 on the outer
  parameters at the round start, ``outer_round`` with Mix2 and the Nesterov outer step).
- :class:`PipelineSim`: S stages × R replicas (:func:`agoractl.model.build.build_stage`), each
  microbatch routed to a random replica per stage for its forward; the backward either pinned to the
  same replicas or routed anew (report §4.2.1, §6.2). Workers are stateless, so a backward recomputes
  the stage's forward on the weights of whichever replica runs it. AsyncSPARTA rounds use
  :mod:`agoractl.algorithms.sparta` (segment tiling, weighted average, delta rule), with a lag of some
  steps between the snapshot and the applied average, and optional injected failures.

The data is the run's shards when they exist (``run_sequences``), else the sample corpus's lesson
text generated in memory (:func:`lesson_sequences`). Wall-clock time is not measured here: the
scenarios put the per-step results on a time axis with :mod:`agoractl.sim.comm_model`.
"""

from __future__ import annotations

import random
import time
from itertools import product
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from agoractl import storage
from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.schema import Run
from agoractl.algorithms.consensus import js_distance, l2_distance, pairwise
from agoractl.algorithms.fgdiloco import OuterSGD, mix, outer_round, random_matching, variant_mixing
from agoractl.model.build import build_model, build_stage, stage_parameter_names
from agoractl.model.llama import lm_loss, split_sample
from agoractl.algorithms.optim import lr_at, make_optimizer, optimizer_step
from agoractl.algorithms.sparta import SegmentTiling, apply_round, weighted_average

# ---- data -----------------------------------------------------------------------------------------


def lesson_sequences(run: Run, seed: int = 0) -> Iterator[torch.Tensor]:
    """Endless packed ``seq_len + 1`` sequences of the sample corpus's lesson text, made in memory.

    The same documents `agoractl data sample` writes to parquet (same generator), tokenized with the
    run's tokenizer, one EOS per document, cut into non-overlapping sequences like the shard reader.
    """
    from agoractl.data.sample import document
    from agoractl.data.tokenizers import load_tokenizer

    tok = load_tokenizer(run)
    rng = random.Random(f"agoractl-simulate-{seed}")
    length = run.model.seq_len + 1
    buf: list[int] = []
    number = 0
    while True:
        number += 1
        buf.extend(tok.encode(document(rng, number)[1]))
        buf.append(tok.eos_id)
        while len(buf) >= length:
            yield torch.tensor(buf[:length], dtype=torch.long)
            del buf[:length]


def shards_exist(run: Run) -> bool:
    from agoractl.data.index import index_url

    url = index_url(run.data.output)
    try:
        fs, path = storage.filesystem(url)
        return bool(fs.exists(path))
    except Exception:
        return False


def open_sequences(run: Run, data: str = "auto", seed: int = 0) -> tuple[Iterator[torch.Tensor], str]:
    """(sample iterator, description): ``shards`` = the run's shards, ``synthetic`` = lesson text in
    memory, ``auto`` = shards when ``<data.output>/index.json`` exists, else synthetic."""
    if data not in ("auto", "shards", "synthetic"):
        raise UsageError(f"--data: one of auto, shards, synthetic; got {data!r}")
    if data == "shards" or (data == "auto" and shards_exist(run)):
        from agoractl.data.stream import run_sequences

        return run_sequences(run, wrap=True), f"shards:{run.data.output}"
    return lesson_sequences(run, seed), "synthetic:lessons (the sample corpus's generator, in memory)"


class Batcher:
    """Takes consecutive samples from one stream: the same stream, split across replicas."""

    def __init__(self, stream: Iterator[torch.Tensor]):
        self.stream = stream

    def take(self, n: int) -> torch.Tensor:
        try:
            return torch.stack([next(self.stream) for _ in range(n)])
        except StopIteration:
            raise RuntimeFailure("the data stream ran out during the simulation",
                                 hint="use fewer --rounds/--steps, or more shards") from None


# ---- full-model replicas (FGDiLoCo) ---------------------------------------------------------------


def flat_parameters(module: torch.nn.Module) -> torch.Tensor:
    """All parameters as one flat fp32 vector (a copy): what an FGDiLoCo round mixes."""
    return parameters_to_vector([p.detach() for p in module.parameters()]).clone()


@torch.no_grad()
def assign_parameters_(module: torch.nn.Module, flat: torch.Tensor) -> None:
    vector_to_parameters(flat, list(module.parameters()))


class Replica:
    """One full-model replica: the model, its inner AdamW and its stage-wise clipping groups.

    Clipping follows the manifest as the workers apply it: each stage's parameters on their own
    (threshold ``run.clip_threshold(i)``), or all together in mode ``global``.
    """

    def __init__(self, run: Run):
        self.run = run
        self.model = build_model(run)
        named = dict(self.model.named_parameters())
        if run.training.clipping.mode == "global":
            self.groups = [(list(named.values()), run.clip_threshold(0))]
        else:
            self.groups = [([named[n] for n in stage_parameter_names(run, i)], run.clip_threshold(i))
                           for i in range(len(run.stages))]
        self.optimizer = make_optimizer(self.model.parameters(), run)
        self.step = 0

    def inner_step(self, samples: torch.Tensor) -> float:
        """One inner optimizer step on `samples` [B, seq_len + 1]; returns the training loss."""
        inputs, labels = split_sample(samples)
        loss = lm_loss(self.model(inputs), labels)
        loss.backward()
        optimizer_step(self.optimizer, self.groups, lr_at(self.run, self.step))
        self.step += 1
        return float(loss.detach())


@torch.no_grad()
def consensus(models: Sequence[torch.nn.Module], probe: torch.Tensor) -> dict:
    """Consensus of full-model replicas on a fixed probe batch: mean eval loss, pairwise JS distance of
    next-token distributions (mean, max) and pairwise L2 distance of parameters (mean)."""
    inputs, labels = split_sample(probe)
    logits = [m(inputs) for m in models]
    js = pairwise(logits, js_distance)
    l2 = pairwise([flat_parameters(m) for m in models], l2_distance)
    losses = [float(lm_loss(lg, labels)) for lg in logits]
    return {"eval_loss": sum(losses) / len(losses), "js_mean": js["mean"], "js_max": js["max"],
            "l2_mean": l2["mean"]}


class FGDiLoCoSim:
    """M full-model replicas under one FGDiLoCo variant, all starting from the same initialisation.

    :meth:`round` is one outer round exactly as seed 002 writes it: Mix1 on the outer parameters z at
    the round start, H inner steps from y_0 = z, Δ = y_H − y_0, then ``outer_round`` (Mix2 on Δ and
    each replica's Nesterov outer step applied to its Mix1 result).
    """

    def __init__(self, run: Run, variant: str, replicas: int, inner_steps: int, batch: int, seed: int = 0):
        self.kind1, _ = variant_mixing(variant)
        self.variant, self.inner_steps, self.batch = variant, inner_steps, batch
        fg = run.data_parallel.fgdiloco
        self.replicas = [Replica(run) for _ in range(replicas)]
        self.outer = [OuterSGD(lr=fg.outer_lr, momentum=fg.outer_momentum, nesterov=fg.nesterov) for _ in self.replicas]
        self.rng = random.Random(seed)
        self.compute_s = 0.0
        self.steps = 0

    def round(self, batcher: Batcher) -> list[float]:
        """One outer round; returns the mean training loss of each inner step. Each inner step gives
        every replica, in turn, the next `batch` samples of the stream."""
        n = len(self.replicas)
        z = [flat_parameters(rep.model) for rep in self.replicas]
        # Mix1 starts now, on the outer parameters z; a worker finishes it in the background.
        x = mix(self.kind1, z, random_matching(n, self.rng) if self.kind1 == "local" else None)
        losses = []
        for _ in range(self.inner_steps):
            samples = [batcher.take(self.batch) for _ in self.replicas]
            t0 = time.perf_counter()
            losses.append(sum(rep.inner_step(s) for rep, s in zip(self.replicas, samples)) / n)
            self.compute_s += (time.perf_counter() - t0) / n
            self.steps += 1
        y = [flat_parameters(rep.model) for rep in self.replicas]
        for rep, new_z in zip(self.replicas, outer_round(z, y, self.variant, self.outer, self.rng, mix1=x)):
            assign_parameters_(rep.model, new_z)
        return losses

    def consensus(self, probe: torch.Tensor) -> dict:
        return consensus([rep.model for rep in self.replicas], probe)


def run_fgdiloco(run: Run, variant: str, *, replicas: int, rounds: int, inner_steps: int, batch: int,
                 stream: Iterator[torch.Tensor], probe: torch.Tensor, seed: int = 0,
                 extra_rounds: int = 0, stop: Optional[Callable[[int, dict], bool]] = None) -> dict:
    """Train `replicas` full models under FGDiLoCo `variant` for `rounds` rounds of `inner_steps`.

    After `rounds`, up to `extra_rounds` more are run until ``stop(round, record)`` says enough (the
    time-to-loss comparison). Returns the per-step mean training loss, per-round records (mean training
    loss of the round; eval loss, JS and L2 on `probe`) and the seconds this machine spent per inner
    step of one replica.
    """
    sim = FGDiLoCoSim(run, variant, replicas, inner_steps, batch, seed)
    batcher = Batcher(stream)
    losses: list[float] = []
    records: list[dict] = []
    for r in range(rounds + extra_rounds):
        round_losses = sim.round(batcher)
        losses.extend(round_losses)
        # Every sample is new when it is trained on, so a round's mean training loss is a held-out
        # estimate over H x M x batch samples: steadier than the small probe batch.
        record = {"round": r + 1, "step": (r + 1) * inner_steps, "train_loss": sum(round_losses) / len(round_losses),
                  **sim.consensus(probe)}
        records.append(record)
        if r + 1 >= rounds and stop is not None and stop(r + 1, record):
            break
    return {"loss": losses, "rounds": records, "step_time_s": sim.compute_s / max(1, sim.steps)}


# ---- pipeline of stage replicas (AsyncSPARTA) -----------------------------------------------------


class StageReplica:
    """One worker's state in the simulation: its stage module, AdamW, and counters."""

    def __init__(self, run: Run, index: int):
        self.module = build_stage(run, index)
        self.params = dict(self.module.named_parameters())
        self.optimizer = make_optimizer(self.module.parameters(), run)
        self.threshold = run.clip_threshold(index)
        self.microbatches = 0     # backward passes since its last optimizer step
        self.samples = 0          # samples since the last averaging round: its averaging weight


class PipelineSim:
    """S stages × R replicas with random forward routing, pinned or stochastic backward, AsyncSPARTA.

    One :meth:`train_step` routes `global_batch_size` samples in microbatches, then every replica that
    ran a backward steps its own optimizer (the stage has collectively reached its batch). Every
    ``sparta.every_steps`` steps a round snapshots segment ``round mod n_segments`` of every replica,
    averages the participants' snapshots weighted by samples, and after `lag_steps` more steps applies
    it with the delta rule to the participants; a failed replica (each fails on its own with
    probability 1 − participation) neither contributes nor receives.
    """

    def __init__(self, run: Run, replicas: int, *, backward: str = "pinned", seed: int = 0, lag_steps: int = 1):
        if backward not in ("pinned", "stochastic"):
            raise ValueError(f"backward must be pinned or stochastic; got {backward!r}")
        self.run, self.replicas, self.backward, self.lag = run, replicas, backward, lag_steps
        self.stages = [[StageReplica(run, i) for _ in range(replicas)] for i in range(len(run.stages))]
        sp = run.data_parallel.sparta
        self.tilings = [SegmentTiling({n: p.shape for n, p in stage[0].params.items()}, run.n_segments(), sp.seed)
                        for stage in self.stages]
        # Separate generators, so forward routes (and data) are the same whichever backward rule is used.
        self.route_rng = random.Random(seed)
        self.backward_rng = random.Random(seed + 1)
        self.failure_rng = random.Random(seed + 2)
        self.step = 0
        self.rounds = 0
        self.pending: list[tuple] = []
        self.participation: list[tuple[int, float]] = []   # (step the round started, fraction completing)

    def _pick(self, rng: random.Random) -> list[int]:
        return [rng.randrange(self.replicas) for _ in self.stages]

    def microbatch(self, samples: torch.Tensor) -> float:
        """Forward along a random route, backward pinned or re-routed; returns the forward's loss."""
        inputs, labels = split_sample(samples)
        forward = self._pick(self.route_rng)
        backward = forward if self.backward == "pinned" else self._pick(self.backward_rng)
        wires: list[Optional[torch.Tensor]] = [None]
        with torch.no_grad():
            for s, j in enumerate(forward):
                wires.append(self.stages[s][j].module(wires[-1], inputs))
            loss = float(lm_loss(wires[-1], labels))
        grad: Optional[torch.Tensor] = None
        for s in reversed(range(len(self.stages))):
            rep = self.stages[s][backward[s]]
            # Stateless worker: recompute this stage's forward on the backward replica's own weights.
            inp = wires[s].detach().requires_grad_(True) if wires[s] is not None else None
            out = rep.module(inp, inputs)
            if s == len(self.stages) - 1:
                lm_loss(out, labels).backward()
            else:
                out.backward(grad)
            grad = inp.grad if inp is not None else None
            rep.microbatches += 1
            rep.samples += samples.shape[0]
        return loss

    def train_step(self, samples: torch.Tensor, microbatch: int, participation: float = 1.0) -> float:
        """One stage step over `samples` (the global batch); returns the mean microbatch loss."""
        losses = [self.microbatch(chunk) for chunk in samples.split(microbatch)]
        lr = lr_at(self.run, self.step)
        for stage in self.stages:
            for rep in stage:
                if not rep.microbatches:
                    continue
                optimizer_step(rep.optimizer, [(list(rep.params.values()), rep.threshold)], lr,
                               samples=rep.microbatches)
                rep.microbatches = 0
        self.step += 1
        if self.step % self.run.data_parallel.sparta.every_steps == 0:
            self._start_round(participation)
        self._apply_due()
        return sum(losses) / len(losses)

    def _start_round(self, participation: float) -> None:
        segment = self.rounds % self.run.n_segments()
        completed = 0
        for s, stage in enumerate(self.stages):
            # Every worker fails on its own: each completes the round with probability `participation`.
            members = [j for j in range(self.replicas) if participation >= 1.0 or self.failure_rng.random() < participation]
            completed += len(members)
            snaps = [self.tilings[s].gather(rep.params, segment) for rep in stage]
            weights = [stage[j].samples if j in members else 0 for j in range(self.replicas)]
            average = weighted_average(snaps, weights) if members else None
            self.pending.append((self.step + self.lag, s, segment, snaps, average, members))
            for rep in stage:
                rep.samples = 0
        self.participation.append((self.step, completed / (self.replicas * len(self.stages))))
        self.rounds += 1

    def _apply_due(self) -> None:
        due = [p for p in self.pending if p[0] <= self.step]
        self.pending = [p for p in self.pending if p[0] > self.step]
        delta_rule = self.run.data_parallel.sparta.delta_rule
        for _, s, segment, snaps, average, members in due:
            for j in members:
                apply_round(self.stages[s][j].params, self.tilings[s], segment, snaps[j], average, delta_rule)

    def routes(self, limit: int = 16) -> list[tuple[int, ...]]:
        """Every route through the stages, or a fixed sample of `limit` of them."""
        if self.replicas ** len(self.stages) <= limit:
            return list(product(range(self.replicas), repeat=len(self.stages)))
        rng, routes = random.Random(0), set()
        while len(routes) < limit:
            routes.add(tuple(rng.randrange(self.replicas) for _ in self.stages))
        return sorted(routes)

    @torch.no_grad()
    def eval_loss(self, probe: torch.Tensor, limit: int = 16) -> float:
        """Mean loss on `probe` over the routes a trainer could take (all of them, or a fixed sample)."""
        inputs, labels = split_sample(probe)
        total = 0.0
        routes = self.routes(limit)
        for route in routes:
            wire = None
            for s, j in enumerate(route):
                wire = self.stages[s][j].module(wire, inputs)
            total += float(lm_loss(wire, labels))
        return total / len(routes)
