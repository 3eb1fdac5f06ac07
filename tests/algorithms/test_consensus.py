"""Unit tests of the consensus distances (agoractl.algorithms.consensus): in-memory, no I/O."""

import math

import pytest
import torch

from agoractl.algorithms.consensus import js_distance, js_divergence, l2_distance, pairwise


def test_js_identical_is_zero_and_symmetric():
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(2, 3, 11, generator=g), torch.randn(2, 3, 11, generator=g)
    assert js_distance(p, p) == 0.0
    assert js_distance(p * 50, p.clone() * 50) == 0.0
    assert js_distance(p, q) == pytest.approx(js_distance(q, p))
    assert js_divergence(p, q).shape == (2, 3)


def test_js_disjoint_is_one_bit():
    # Two distributions with disjoint support: JSD = 1 bit exactly, so the distance is 1.
    big = 60.0
    p = torch.tensor([[big, 0.0, -big, -big]])
    q = torch.tensor([[-big, -big, big, 0.0]])
    assert js_distance(p, q) == pytest.approx(1.0, abs=1e-6)


def test_js_matches_closed_form():
    # p = (1, 0), q = (1/2, 1/2): M = (3/4, 1/4); JSD = 1/2 KL(p||M) + 1/2 KL(q||M), in bits.
    p = torch.tensor([[0.0, -200.0]])
    q = torch.tensor([[0.0, 0.0]])
    kl_pm = math.log2(1 / 0.75)
    kl_qm = 0.5 * math.log2(0.5 / 0.75) + 0.5 * math.log2(0.5 / 0.25)
    assert js_distance(p, q) == pytest.approx(math.sqrt(0.5 * (kl_pm + kl_qm)), rel=1e-9)


def test_js_shape_mismatch():
    with pytest.raises(ValueError, match="logit shapes differ"):
        js_distance(torch.zeros(2, 5), torch.zeros(2, 6))


def test_js_is_a_metric_triangle():
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(1, 7, generator=g) * 3 for _ in range(3))
    assert js_distance(a, c) <= js_distance(a, b) + js_distance(b, c) + 1e-9


def test_pairwise_mean_max():
    vecs = [torch.tensor([0.0, 0.0]), torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0])]
    out = pairwise(vecs, l2_distance)
    assert [p[:2] for p in out["pairs"]] == [[0, 1], [0, 2], [1, 2]]
    assert out["max"] == pytest.approx(5.0)
    assert out["mean"] == pytest.approx(10.0 / 3)
    assert pairwise(vecs[:1], l2_distance) == {"pairs": [], "mean": 0.0, "max": 0.0}
