"""The local optimizer of a stage: AdamW, the learning-rate schedule, stage-wise clipping (report §4.3).

Shared by workers (each steps its own stage) and the centralized reference (which steps the whole
model, clipping each stage's parameters on their own unless the manifest says otherwise).
Weight decay applies to matrices only (ndim ≥ 2), not to norm gains, biases or dummy vectors.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from agoractl.manifest.schema import Run


def make_optimizer(params: Iterable[torch.nn.Parameter], run: Run) -> torch.optim.AdamW:
    """AdamW with the manifest's betas, eps and weight decay; lr starts at lr_at(run, 0)."""
    o = run.training.optimizer
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr_at(run, 0), betas=tuple(o.betas),
                             eps=o.eps)


def lr_at(run: Run, step: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up over warmup_steps (step 0
    gets lr/warmup), then cosine decay to min_lr_ratio·lr at max_steps, or constant."""
    t = run.training
    peak, sched = t.optimizer.lr, t.schedule
    if step < sched.warmup_steps:
        return peak * (step + 1) / sched.warmup_steps
    if sched.kind == "constant":
        return peak
    span = max(1, t.max_steps - sched.warmup_steps)
    progress = min(1.0, max(0.0, (step - sched.warmup_steps) / span))
    return peak * (sched.min_lr_ratio + (1 - sched.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_stage_(params: Iterable[torch.nn.Parameter], threshold: Optional[float]) -> float:
    """Clip the gradients of `params` to total L2 norm `threshold` in place (None: only measure).

    Returns the norm before clipping (0.0 when no parameter has a gradient). Use
    ``run.clip_threshold(stage_index)`` for the threshold: 1/sqrt(S), doubled for the tail.
    """
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if threshold is None:
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float())
                                                           for p in grads])))
    return float(torch.nn.utils.clip_grad_norm_(grads, threshold))
