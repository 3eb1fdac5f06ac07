"""Inter-replica divergence maths (report §5.7.2): per-segment population variance, consensus
movement and pairwise L2 distance, accumulated chunk by chunk.

Pure tensor code, no I/O: :mod:`agoractl.ops.analyze` reads the same element range of one parameter
from every replica's snapshot and feeds it here as an ``[R, n]`` block, so memory stays bounded
whatever the stage size. Everything is accumulated in float64.

- Segment variance (§5.7.2.1): for every trainable parameter element, the population variance of
  its value across the R replicas (divide by R), averaged within each SPARTA segment.
- Consensus movement (§5.7.2.3): the consensus mean is the element-wise mean over replicas; its
  movement between two snapshot steps is the mean over elements of the squared change, in the same
  units as the variance so that the two can be compared as in the report's figure 30.
- Pairwise L2: the Euclidean distance between two replicas' flattened parameters, for every pair,
  from the Gram matrix of the centred values (exact, no all-replica copy needed).
"""

from __future__ import annotations

import itertools
import math
from typing import Optional

import torch


def distances_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """Pairwise Euclidean distances from a Gram matrix G (||a_i - a_j||^2 = G_ii + G_jj - 2 G_ij)."""
    diag = torch.diagonal(gram)
    sq = (diag[:, None] + diag[None, :] - 2 * gram).clamp_(min=0)
    return sq.sqrt()


def pair_values(matrix: torch.Tensor) -> list[float]:
    """The upper-triangle values of a symmetric pairwise matrix, pair (0,1), (0,2), ..."""
    n = matrix.shape[0]
    return [float(matrix[i, j]) for i, j in itertools.combinations(range(n), 2)]


class StepStatistics:
    """Divergence statistics of one stage at one snapshot step, fed ``[R, n]`` blocks of elements.

    ``add`` returns the block's consensus mean (float64) so the caller can keep it for the movement
    at the next step; ``previous_mean`` is the same block's consensus mean at the previous step.
    """

    def __init__(self, replicas: int, segments: int):
        if replicas < 1:
            raise ValueError("at least one replica")
        self.replicas, self.segments = replicas, segments
        self.var_sum = torch.zeros(segments, dtype=torch.float64)
        self.count = torch.zeros(segments, dtype=torch.int64)
        self.gram = torch.zeros(replicas, replicas, dtype=torch.float64)
        self.move_sq = 0.0
        self.move_count = 0

    def add(self, block: torch.Tensor, segment_ids: torch.Tensor,
            previous_mean: Optional[torch.Tensor] = None, scratch: bool = False) -> torch.Tensor:
        """Fold in an ``[R, n]`` block; returns its consensus mean. With `scratch`, a float64 block
        is centred in place instead of copied (the analysis passes its reusable read buffer)."""
        if block.dim() != 2 or block.shape[0] != self.replicas:
            raise ValueError(f"expected a [{self.replicas}, n] block; got {tuple(block.shape)}")
        if segment_ids.numel() != block.shape[1]:
            raise ValueError("one segment id per element")
        d = block if scratch and block.dtype == torch.float64 else block.to(torch.float64, copy=True)
        # Row by row, in place: broadcasting over [R, n] allocates R x n temporaries, several times slower.
        mean = d[0].clone()
        for row in d[1:]:
            mean.add_(row)
        mean.div_(self.replicas)
        for row in d:
            row.sub_(mean)
        var = d[0] * d[0]
        for row in d[1:]:
            var.addcmul_(row, row)
        var.div_(self.replicas)
        ids = segment_ids.long()
        self.var_sum.scatter_add_(0, ids, var)
        self.count += torch.bincount(ids, minlength=self.segments)
        self.gram += d @ d.T
        if previous_mean is not None:
            change = mean - previous_mean
            self.move_sq += float(change.dot(change))
            self.move_count += change.numel()
        return mean

    @property
    def elements(self) -> int:
        return int(self.count.sum())

    def segment_variance(self) -> list[Optional[float]]:
        """Mean inter-replica variance of each segment (None for a segment with no elements)."""
        return [float(s / c) if c else None for s, c in zip(self.var_sum, self.count)]

    def mean_variance(self) -> float:
        n = self.elements
        return float(self.var_sum.sum() / n) if n else 0.0

    def consensus_movement(self) -> Optional[float]:
        """Mean squared change of the consensus mean since the previous step (None without one)."""
        return self.move_sq / self.move_count if self.move_count else None

    def l2_matrix(self) -> torch.Tensor:
        return distances_from_gram(self.gram)

    def l2_pairs(self) -> list[float]:
        return pair_values(self.l2_matrix())

    def l2_mean(self) -> Optional[float]:
        pairs = self.l2_pairs()
        return sum(pairs) / len(pairs) if pairs else None

    def l2_max(self) -> Optional[float]:
        pairs = self.l2_pairs()
        return max(pairs) if pairs else None


def recency_ranks(last_segment: int, segments: int) -> list[int]:
    """Rounds since each segment was last averaged, when round r averages segment r mod S and the
    last completed round averaged `last_segment`: 0 for it, 1 for the one before, ... S-1."""
    return [(last_segment - s) % segments for s in range(segments)]


def recency_correlation(variances: list[Optional[float]], last_segment: int) -> Optional[float]:
    """Pearson correlation between a segment's variance and the rounds since it was averaged; the
    report's linear-in-recency pattern (§5.7.2.1) shows as a value near +1."""
    ranks = recency_ranks(last_segment, len(variances))
    pts = [(r, v) for r, v in zip(ranks, variances) if v is not None]
    if len(pts) < 3:
        return None
    mr = sum(r for r, _ in pts) / len(pts)
    mv = sum(v for _, v in pts) / len(pts)
    cov = sum((r - mr) * (v - mv) for r, v in pts)
    sr = math.sqrt(sum((r - mr) ** 2 for r, _ in pts))
    sv = math.sqrt(sum((v - mv) ** 2 for _, v in pts))
    return cov / (sr * sv) if sr and sv else None
