"""Tests of the divergence maths (agoractl.ops.divergence) against direct numpy computations:
population variance per segment, consensus movement, pairwise L2, chunking invariance. In-memory."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from agoractl.ops.divergence import StepStatistics, recency_correlation, recency_ranks


def _reference(x: np.ndarray, seg: np.ndarray, segments: int):
    var = x.var(axis=0)  # numpy's default ddof=0: the population variance
    per_seg = [var[seg == s].mean() for s in range(segments)]
    dists = [np.linalg.norm(x[i] - x[j]) for i, j in itertools.combinations(range(x.shape[0]), 2)]
    return per_seg, var.mean(), dists


@pytest.mark.parametrize("chunk", [7, 1000])
def test_step_statistics_match_numpy(chunk):
    g = np.random.default_rng(0)
    R, n, S = 5, 1000, 4
    x = g.normal(0.3, 1.0, (R, n)) * g.uniform(0.1, 2.0, n)
    seg = g.integers(0, S, n)
    stats = StepStatistics(R, S)
    for lo in range(0, n, chunk):
        stats.add(torch.from_numpy(x[:, lo:lo + chunk]), torch.from_numpy(seg[lo:lo + chunk]).to(torch.uint8))
    per_seg, mean_var, dists = _reference(x, seg, S)
    np.testing.assert_allclose(stats.segment_variance(), per_seg, rtol=1e-12)
    assert stats.mean_variance() == pytest.approx(mean_var, rel=1e-12)
    np.testing.assert_allclose(stats.l2_pairs(), dists, rtol=1e-9)
    assert stats.l2_mean() == pytest.approx(np.mean(dists), rel=1e-9)
    assert stats.l2_max() == pytest.approx(np.max(dists), rel=1e-9)
    assert stats.consensus_movement() is None


def test_consensus_movement_is_mean_squared_change_of_the_mean():
    g = np.random.default_rng(1)
    a, b = g.normal(size=(3, 50)), g.normal(size=(3, 50))
    seg = torch.zeros(50, dtype=torch.uint8)
    first = StepStatistics(3, 1)
    mean_a = first.add(torch.from_numpy(a), seg)
    second = StepStatistics(3, 1)
    second.add(torch.from_numpy(b), seg, previous_mean=mean_a)
    expected = ((b.mean(0) - a.mean(0)) ** 2).mean()
    assert second.consensus_movement() == pytest.approx(expected, rel=1e-12)


def test_single_replica_has_no_pairs_and_empty_segments_are_none():
    stats = StepStatistics(1, 3)
    stats.add(torch.ones(1, 4), torch.tensor([0, 0, 1, 1], dtype=torch.uint8))
    assert stats.segment_variance() == [0.0, 0.0, None]
    assert stats.l2_mean() is None and stats.l2_max() is None


def test_recency():
    assert recency_ranks(2, 4) == [2, 1, 0, 3]
    # Variance growing linearly with rounds since averaging correlates perfectly.
    assert recency_correlation([2.0, 1.0, 0.0, 3.0], 2) == pytest.approx(1.0)
    assert recency_correlation([1.0, 2.0, 3.0, 0.0], 2) < 0
