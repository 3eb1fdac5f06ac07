"""The local optimizer of a stage: AdamW, the learning-rate schedule, stage-wise clipping (report §4.3),
and :func:`optimizer_step`, the one optimizer step that workers, the simulator and the centralized
reference all take.

Workers step their own stage; the centralized reference and the simulator's full-model replicas step
the whole model, clipping each stage's parameters on their own unless the manifest says otherwise.
Weight decay applies to matrices only (ndim ≥ 2), not to norm gains, biases or dummy vectors.

The optimizer is torch's ``torch.optim.AdamW``: fused where the parameters' device has the fused
kernel (CPU and CUDA in torch ≥ 2.4), else foreach. Its first construction imports ``torch._dynamo``
(about 1.7 s of CPU on this project's 2-core machine), once per process, while the node starts; no
optimizer call after that imports anything (tests/algorithms/test_optim.py). Checkpoints written by
the hand-written AdamW of agoractl ≤ 0.1.0 have torch's state layout and load unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from agoractl.manifest.schema import Run

ClipGroup = tuple[Sequence[torch.nn.Parameter], Optional[float]]
"""Parameters clipped together, and their threshold (None: measured, not clipped)."""


def _adamw(groups: list[dict], **kw) -> torch.optim.AdamW:
    """torch's AdamW, fused if every parameter's device and dtype have the fused kernel, else foreach."""
    try:
        optimizer = torch.optim.AdamW(groups, fused=True, **kw)
    except RuntimeError:  # a device without the fused kernel (torch names the tensor it refused)
        optimizer = torch.optim.AdamW(groups, foreach=True, **kw)
    kernels = {k: optimizer.defaults[k] for k in ("fused", "foreach")}

    def keep_kernels(opt: torch.optim.Optimizer) -> None:
        # load_state_dict takes the saved groups' flags (None from a hand-written AdamW's checkpoint,
        # fused from a CUDA node's): this optimizer keeps the kernel chosen for its own parameters.
        for group in opt.param_groups:
            group.update(kernels)
            if kernels["fused"]:
                for p in group["params"]:
                    st = opt.state.get(p)
                    if st and st["step"].device != p.device:
                        st["step"] = st["step"].to(p.device, torch.float32)

    optimizer.register_load_state_dict_post_hook(keep_kernels)
    return optimizer


def make_optimizer(params: Iterable[torch.nn.Parameter], run: Run) -> torch.optim.AdamW:
    """AdamW with the manifest's betas, eps and weight decay; lr starts at lr_at(run, 0)."""
    o = run.training.optimizer
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return _adamw([g for g in groups if g["params"]], lr=lr_at(run, 0), betas=tuple(o.betas), eps=o.eps)


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



@dataclass(frozen=True)
class StepResult:
    """What :func:`optimizer_step` did: each clip group's gradient norm before clipping, and whether
    the optimizer stepped (False when a norm was not finite: the update is skipped, gradients dropped)."""

    norms: list[float]
    stepped: bool


@torch.no_grad()
def optimizer_step(optimizer: torch.optim.Optimizer, groups: Sequence[ClipGroup], lr: float, *,
                   samples: float = 1.0, master: Optional[Sequence[torch.nn.Parameter]] = None) -> StepResult:
    """One optimizer step of a stage (or a whole model) from its accumulated gradients.

    Divides the gradients by `samples` (what they were summed over; 1 when the loss was already a
    mean), clips each group to its threshold (stage-wise clipping, :func:`clip_stage_`), sets the
    learning rate to `lr`, steps and drops every gradient. With `master` (CPU master weights of a
    device's compute copies, in the groups' parameter order) the gradients move to the master
    weights, the optimizer steps those, and the compute copies take the new values.
    """
    params = [p for ps, _ in groups for p in ps]
    if samples != 1:
        for p in params:
            if p.grad is not None:
                p.grad.div_(samples)
    norms = [clip_stage_(ps, threshold) for ps, threshold in groups]
    stepped = all(math.isfinite(n) for n in norms)
    if stepped:
        if master is not None:
            for m, p in zip(master, params):
                m.grad = None if p.grad is None else p.grad.to(m.device)
        set_lr(optimizer, lr)
        optimizer.step()
        if master is not None:
            for m, p in zip(master, params):
                p.copy_(m, non_blocking=True)
    optimizer.zero_grad(set_to_none=True)
    for p in params:
        p.grad = None
    return StepResult(norms, stepped)
