"""Factored Gossip DiLoCo maths (seed 002): mixing, outer gradients and the Nesterov outer step.

Pure functions and one small class, no networking; the simulator and the real worker share them.
One round of replica m:

    x_m   = Mix1(z)_m            non-blocking, started on the outer parameters z at the round start
    y_m,0 = z_m;  y_m,H = H inner AdamW steps
    Δ_m   = y_m,H − y_m,0        (the outer gradient is −Δ_m)
    Δ̂_m   = Mix2(Δ)_m            blocking
    z_m   ← OuterSGD(x_m, Δ̂_m)   SGD with (Nesterov) momentum, applied to the Mix1 result

Mixing is ``global`` (average over all replicas), ``local`` (pairwise averaging with a random
partner: a random perfect matching, one replica left alone when the count is odd) or ``none``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

# variant -> (Mix1, Mix2)
VARIANTS: dict[str, tuple[str, str]] = {
    "diloco": ("none", "global"),
    "global_m1": ("global", "none"),
    "global_m1_local_m2": ("global", "local"),
    "local_m1_m2": ("local", "local"),
}

Matching = list[tuple[int, Optional[int]]]


def variant_mixing(variant: str) -> tuple[str, str]:
    """(Mix1, Mix2) kinds of a variant name; ValueError listing the valid names otherwise."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown FGDiLoCo variant {variant!r}; one of {', '.join(VARIANTS)}")
    return VARIANTS[variant]


def random_matching(n: int, rng: random.Random) -> Matching:
    """A random perfect matching of replicas 0..n-1: pairs (a, b), and (c, None) for the odd one out."""
    order = list(range(n))
    rng.shuffle(order)
    pairs: Matching = [(order[i], order[i + 1]) for i in range(0, n - 1, 2)]
    if n % 2:
        pairs.append((order[-1], None))
    return pairs


def partner_of(matching: Matching, replica: int) -> Optional[int]:
    for a, b in matching:
        if a == replica:
            return b
        if b == replica:
            return a
    raise ValueError(f"replica {replica} is not in the matching")


def mix(kind: str, values: Sequence[torch.Tensor], matching: Optional[Matching] = None) -> list[torch.Tensor]:
    """Mix one tensor per replica: 'none' copies, 'global' averages all, 'local' averages matched pairs."""
    if kind == "none":
        return [v.clone() for v in values]
    if kind == "global":
        avg = torch.stack([v.float() for v in values]).mean(0).to(values[0].dtype)
        return [avg.clone() for _ in values]
    if kind == "local":
        if matching is None:
            raise ValueError("local mixing needs a matching")
        out = [v.clone() for v in values]
        for a, b in matching:
            if b is not None:
                avg = (values[a].float() + values[b].float()).div(2).to(values[a].dtype)
                out[a], out[b] = avg.clone(), avg.clone()
        return out
    raise ValueError(f"unknown mixing {kind!r}; one of none, global, local")


def round_delta(start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Δ = y_H − y_0: what a replica's inner steps moved its parameters in one round (Mix2 mixes it)."""
    return end - start


def outer_gradient(start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """The outer gradient of a round: −Δ = y_0 − y_H (a descent direction points along −gradient)."""
    return start - end


@dataclass
class OuterSGD:
    """SGD with (Nesterov) momentum for the outer step; one instance per replica (its momentum is local)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    buffer: Optional[torch.Tensor] = None

    def step(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """New outer parameters z = x − lr · (g + μ·v) with v ← μ·v + g (Nesterov), or x − lr·v."""
        g = grad.float()
        if self.momentum:
            self.buffer = g.clone() if self.buffer is None else self.buffer.mul_(self.momentum).add_(g)
            g = g + self.momentum * self.buffer if self.nesterov else self.buffer
        return (x.float() - self.lr * g).to(x.dtype)

    def state_dict(self) -> dict:
        return {"buffer": self.buffer}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = state.get("buffer")


def replica_outer_step(x: torch.Tensor, mixed_delta: torch.Tensor, opt: OuterSGD) -> torch.Tensor:
    """One replica's outer step, z_{r+1} = OuterOpt(x, Δ̂): the outer gradient is −Δ̂.

    The per-replica update shared by the simulator (through :func:`outer_round`) and the real worker,
    which gets `x` from its background Mix1 and `mixed_delta` from its blocking Mix2.
    """
    return opt.step(x, -mixed_delta)


def outer_round(z: Sequence[torch.Tensor], y_end: Sequence[torch.Tensor], variant: str,
                optimizers: Sequence[OuterSGD], rng: random.Random,
                mix1: Optional[Sequence[torch.Tensor]] = None) -> list[torch.Tensor]:
    """One whole outer round for all replicas at once (the simulator's form).

    `z` are the outer parameters at the round start (y_0 = z), `y_end` the parameters after H inner
    steps; `mix1`, when given, is the already finished Mix1 result (the real worker computes it in the
    background), else it is computed here. Returns the new outer parameters z_{r+1} per replica.
    """
    kind1, kind2 = variant_mixing(variant)
    n = len(z)
    x = list(mix1) if mix1 is not None else mix(kind1, z, random_matching(n, rng) if kind1 == "local" else None)
    deltas = [round_delta(start, end) for start, end in zip(z, y_end)]
    mixed = mix(kind2, deltas, random_matching(n, rng) if kind2 == "local" else None)
    return [replica_outer_step(x[m], mixed[m], opt) for m, opt in enumerate(optimizers)]
