"""Consensus distances between replicas: Jensen–Shannon distance of next-token distributions and L2.

Pure functions on tensors, no I/O; the simulator and `analyze divergence` share them. Seed 002
argues that the JS distance of the replicas' predictions tracks optimisation stability far better
than the L2 distance of their parameters.

- ``js_distance(p_logits, q_logits)``: per position, the square root of the Jensen–Shannon
  divergence in base 2 between softmax(p) and softmax(q) (a metric in [0, 1]), averaged over every
  leading position (batch × time).
- ``l2_distance(a, b)``: Euclidean distance of two flat parameter vectors.
- ``pairwise(items, distance)``: the distance of every unordered replica pair, with mean and max.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence, TypeVar

import torch

T = TypeVar("T")

_LN2 = math.log(2.0)


def js_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence in bits between softmax(p) and softmax(q) along the last dim.

    Returns one value per leading position (shape ``p_logits.shape[:-1]``), each in [0, 1].
    Computed in log space so that near-zero probabilities neither underflow nor yield NaN; identical
    inputs give exactly 0.
    """
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(p_logits.shape)} vs {tuple(q_logits.shape)}")
    lp = torch.log_softmax(p_logits.double(), dim=-1)
    lq = torch.log_softmax(q_logits.double(), dim=-1)
    # log of the mixture (p + q) / 2, written so that it equals lp exactly where lp == lq: identical
    # predictions are then exactly 0 apart instead of sqrt(rounding) ~ 1e-8.
    lm = torch.maximum(lp, lq) + torch.log1p(torch.expm1(-(lp - lq).abs()) / 2)
    kl_pm = (lp.exp() * (lp - lm)).sum(-1)
    kl_qm = (lq.exp() * (lq - lm)).sum(-1)
    return (0.5 * (kl_pm + kl_qm) / _LN2).clamp_(0.0, 1.0)


def js_distance(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of sqrt(JSD base 2): 0 for identical predictions, 1 for disjoint ones."""
    return float(js_divergence(p_logits, q_logits).sqrt().mean())


def l2_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Euclidean distance between two parameter vectors (flattened)."""
    return float((a.detach().double().reshape(-1) - b.detach().double().reshape(-1)).norm())


def pairwise(items: Sequence[T], distance: Callable[[T, T], float]) -> dict:
    """`distance` over every unordered pair of `items`: {"pairs": [[i, j, d], ...], "mean", "max"}.

    Fewer than two items give mean = max = 0 (one replica is in consensus with itself).
    """
    pairs = [[i, j, float(distance(items[i], items[j]))] for i, j in itertools.combinations(range(len(items)), 2)]
    values = [d for _, _, d in pairs]
    return {"pairs": pairs, "mean": sum(values) / len(values) if values else 0.0,
            "max": max(values) if values else 0.0}
