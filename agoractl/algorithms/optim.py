"""The local optimizer of a stage: AdamW, the learning-rate schedule, stage-wise clipping (report §4.3).

Shared by workers (each steps its own stage) and the centralized reference (which steps the whole
model, clipping each stage's parameters on their own unless the manifest says otherwise).
Weight decay applies to matrices only (ndim ≥ 2), not to norm gains, biases or dummy vectors.

:class:`AdamW` is torch's AdamW update (its single-tensor path, which torch takes for CPU tensors),
written out: ``torch.optim`` imports ``torch._dynamo`` on an optimizer's first use, about two seconds
of CPU in every worker process, for a compiler no node uses. Its ``state_dict()`` has torch's layout,
so checkpoints and joining states read and write the same files either way.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch

from agoractl.manifest.schema import Run


class AdamW:
    """AdamW (decoupled weight decay) over parameter groups, each a dict with ``params`` and any of
    ``lr``, ``betas``, ``eps``, ``weight_decay`` (defaults from the constructor)."""

    def __init__(self, groups: Iterable[dict], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        self.defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.param_groups: list[dict[str, Any]] = [{**self.defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self) -> None:
        for g in self.param_groups:
            lr, (beta1, beta2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state.get(p)
                if st is None:
                    st = self.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                          "exp_avg_sq": torch.zeros_like(p)}
                st["step"] += 1
                t = float(st["step"])
                if wd:
                    p.mul_(1 - lr * wd)
                st["exp_avg"].lerp_(p.grad, 1 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (st["exp_avg_sq"].sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
                p.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - beta1 ** t))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self) -> dict:
        """torch's layout: ``state`` keyed by the parameter's position across the groups."""
        index = {id(p): i for i, p in enumerate(self._params())}
        groups, start = [], 0
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": {index[id(p)]: dict(st) for p, st in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Hyper-parameters and moments from `state_dict` (this class's or torch's AdamW's)."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"optimizer state has groups of {[len(g['params']) for g in saved]} parameters; "
                             f"this optimizer has {[len(g['params']) for g in self.param_groups]}")
        by_index = {}
        for g, s in zip(self.param_groups, saved):
            for key in ("lr", "betas", "eps", "weight_decay"):
                if key in s:
                    g[key] = tuple(s[key]) if key == "betas" else s[key]
            by_index.update(zip(s["params"], g["params"]))
        self.state = {}
        for i, st in state_dict["state"].items():
            p = by_index.get(int(i))
            if p is None:
                raise ValueError(f"optimizer state has moments for parameter {i}, which no group names")
            self.state[p] = {"step": torch.as_tensor(st["step"], dtype=torch.float32).clone(),
                             "exp_avg": st["exp_avg"].to(p.device, p.dtype).clone(),
                             "exp_avg_sq": st["exp_avg_sq"].to(p.device, p.dtype).clone()}


def make_optimizer(params: Iterable[torch.nn.Parameter], run: Run) -> AdamW:
    """AdamW with the manifest's betas, eps and weight decay; lr starts at lr_at(run, 0)."""
    o = run.training.optimizer
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return AdamW([g for g in groups if g["params"]], lr=lr_at(run, 0), betas=tuple(o.betas), eps=o.eps)


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


def set_lr(optimizer: AdamW, lr: float) -> None:
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
