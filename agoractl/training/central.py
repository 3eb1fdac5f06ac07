"""The centralized reference (report §5.5): the whole model in one process, trained like the swarm.

Same model (with the same SSN reparameterization), same data stream (all trainers' shards
interleaved, :func:`agoractl.data.stream.run_sequences`), same global batch per optimizer step,
same AdamW, schedule and clipping: with ``clipping.mode: stagewise`` each stage's parameters are
clipped on their own to ``run.clip_threshold(i)``, as the stage's workers do; SPARTA with a single
replica is the identity, so nothing else differs. The loss of a step is the mean cross-entropy
over its global batch, computed in micro-batches of at most ``workers.max_microbatch`` samples
whose gradients accumulate (each weighted by its share of the batch).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

import torch

from agoractl.errors import RuntimeFailure
from agoractl.manifest.schema import Run
from agoractl.model.build import build_model, count_module, stage_parameter_names
from agoractl.model.llama import lm_loss, split_sample
from agoractl.algorithms.optim import lr_at, make_optimizer, optimizer_step
from agoractl.ops.checkpoint import Checkpoint, due
from agoractl.training.report import run_report

StepCallback = Callable[[dict], None]
CheckpointCallback = Callable[[int, torch.nn.Module, object], None]


def pick_device(name: str = "auto") -> torch.device:
    """`auto`: CUDA when present, else the CPU; otherwise the named device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def clip_groups(run: Run, model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Parameter], Optional[float]]]:
    """(label, parameters, threshold) per clipping unit: each stage (stagewise), the whole model
    (global), or the whole model unclipped (none)."""
    params = dict(model.named_parameters())
    mode = run.training.clipping.mode
    if mode == "stagewise":
        return [(name, [params[n] for n in stage_parameter_names(run, i)], run.clip_threshold(i))
                for i, name in enumerate(run.stage_names())]
    return [("model", list(params.values()), run.clip_threshold(0))]


def batches(samples: Iterator[torch.Tensor], size: int) -> Iterator[torch.Tensor]:
    """Stack `size` samples per batch; a final partial batch is dropped (it would be a smaller step)."""
    buf: list[torch.Tensor] = []
    for s in samples:
        buf.append(s)
        if len(buf) == size:
            yield torch.stack(buf)
            buf = []


class Central:
    """The monolithic model, its AdamW and clipping groups: :meth:`step` takes one optimizer step."""

    def __init__(self, run: Run, device: torch.device | str = "cpu", microbatch: Optional[int] = None):
        self.run, self.device = run, torch.device(device)
        self.batch_size = run.training.global_batch_size
        self.micro = min(self.batch_size, microbatch or run.workers.max_microbatch)
        self.model = build_model(run, self.device)
        self.model.train()
        self.optimizer = make_optimizer(self.model.parameters(), run)
        self.groups = clip_groups(run, self.model)
        self.step_index = 0

    def step(self, batch: torch.Tensor) -> tuple[float, float, dict[str, float]]:
        """One optimizer step on `batch` [global_batch_size, seq_len + 1]: (loss, lr, grad norm per
        clipping unit, before clipping)."""
        seq_len = self.run.model.seq_len
        if batch.shape[1] != seq_len + 1:
            raise RuntimeFailure(f"the data stream yields samples of {batch.shape[1]} tokens; "
                                 f"model.seq_len + 1 is {seq_len + 1}",
                                 hint="rerun `agoractl shard FILE` with this manifest")
        step = self.step_index
        total = 0.0
        for mb in batch.split(self.micro):
            inputs, labels = split_sample(mb.to(self.device, non_blocking=True))
            loss = lm_loss(self.model(inputs), labels)
            (loss * (mb.shape[0] / self.batch_size)).backward()
            total += loss.item() * mb.shape[0]
        step_loss = total / self.batch_size
        if step_loss != step_loss:  # NaN: stop at once rather than train on garbage
            raise RuntimeFailure(f"the loss became NaN at step {step}",
                                 hint="lower training.optimizer.lr or check training.clipping")
        lr = lr_at(self.run, step)
        result = optimizer_step(self.optimizer, [(params, threshold) for _, params, threshold in self.groups], lr)
        self.step_index += 1
        return step_loss, lr, {label: n for (label, _, _), n in zip(self.groups, result.norms)}


def train_central(run: Run, samples: Iterator[torch.Tensor], device: torch.device | str = "cpu",
                  microbatch: Optional[int] = None, on_step: Optional[StepCallback] = None,
                  resume: Optional[Checkpoint] = None,
                  until: Optional[int] = None, on_checkpoint: Optional[CheckpointCallback] = None) -> dict:
    """Train the monolithic model for training.max_steps steps (fewer if `samples` runs out, or up to
    step `until`) and return the run report (see :mod:`agoractl.training.report`).

    `resume`: the checkpoint to continue from (weights and AdamW state; the schedule follows the step);
    `samples` must then start where that checkpoint's run stopped drawing. `on_checkpoint(step, model,
    optimizer)` runs after every ``checkpoints.every_steps`` steps and after the last step."""
    t = run.training
    central = Central(run, device, microbatch)
    model, optimizer = central.model, central.optimizer
    batch_size, seq_len = central.batch_size, run.model.seq_len
    losses: list[list[float]] = []
    norms: list[list] = []
    step = first = central.step_index = resume.apply_to(model, optimizer) if resume is not None else 0
    last = min(t.max_steps, until or t.max_steps)
    started_at, start = time.time(), time.monotonic()
    for batch in batches(samples, batch_size):
        step_loss, lr, step_norms = central.step(batch)
        losses.append([step, step_loss])
        norms.append([step, step_norms])
        step += 1
        if on_step is not None:
            elapsed = time.monotonic() - start
            on_step({"step": step - 1, "loss": step_loss, "lr": lr, "grad_norm": step_norms,
                     "tokens_per_s": (step - first) * batch_size * seq_len / elapsed if elapsed > 0 else 0.0})
        if on_checkpoint is not None and (due(step, run.checkpoints.every_steps) or step >= last):
            on_checkpoint(step, model, optimizer)
        if step >= last:
            break
    elapsed = time.monotonic() - start
    if step == first:
        raise RuntimeFailure(f"the data stream ran out before the first step (a step needs "
                             f"{batch_size} samples of {seq_len + 1} tokens)",
                             hint="shard a larger corpus, or lower training.global_batch_size")
    trainable, _ = count_module(model)
    return run_report(
        mode="central", name=run.metadata.name, steps=step - first, tokens=(step - first) * batch_size * seq_len,
        elapsed_s=elapsed, loss=losses, started_at=started_at,
        device=str(central.device), precision=t.precision, params=trainable, global_batch_size=batch_size,
        microbatch=central.micro, seq_len=seq_len, max_steps=t.max_steps, completed=step >= last,
        start_step=first, end_step=step,
        grad_norm=norms,
    )
