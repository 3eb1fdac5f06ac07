"""Unit tests of the FGDiLoCo maths (agoractl.algorithms.fgdiloco): in-memory, no network."""

import random

import pytest
import torch

from agoractl.algorithms.fgdiloco import (VARIANTS, OuterSGD, mix, outer_gradient, outer_round, partner_of,
                                       random_matching, replica_outer_step)


def test_outer_gradient_sign_descends():
    # Inner steps moved the parameters from 1.0 to 0.6: the outer step with lr 1, no momentum,
    # must move the outer parameters the same way (towards 0.6), not back.
    start, end = torch.tensor([1.0]), torch.tensor([0.6])
    g = outer_gradient(start, end)
    assert g.item() == pytest.approx(0.4)
    z = OuterSGD(lr=1.0, momentum=0.0).step(start, g)
    assert z.item() == pytest.approx(0.6)
    z = OuterSGD(lr=0.5, momentum=0.0).step(start, g)
    assert z.item() == pytest.approx(0.8)


def test_nesterov_momentum():
    opt = OuterSGD(lr=1.0, momentum=0.5, nesterov=True)
    x = torch.zeros(1)
    g = torch.ones(1)
    x = opt.step(x, g)              # v = 1, update = 1 + 0.5 = 1.5
    assert x.item() == pytest.approx(-1.5)
    x = opt.step(x, g)              # v = 1.5, update = 1 + 0.75
    assert x.item() == pytest.approx(-3.25)
    plain = OuterSGD(lr=1.0, momentum=0.5, nesterov=False)
    y = plain.step(torch.zeros(1), g)
    assert plain.step(y, g).item() == pytest.approx(-2.5)


@pytest.mark.parametrize("n", [2, 5, 8])
def test_random_matching_is_perfect(n):
    m = random_matching(n, random.Random(0))
    seen = [r for pair in m for r in pair if r is not None]
    assert sorted(seen) == list(range(n))
    assert sum(1 for _, b in m if b is None) == n % 2
    for a, b in m:
        assert partner_of(m, a) == b


def test_mixing_kinds():
    vals = [torch.tensor([float(i)]) for i in range(4)]
    assert [v.item() for v in mix("global", vals)] == [1.5] * 4
    assert [v.item() for v in mix("none", vals)] == [0, 1, 2, 3]
    local = mix("local", vals, [(0, 3), (1, 2)])
    assert [v.item() for v in local] == [1.5, 1.5, 1.5, 1.5]
    local = mix("local", vals[:3], [(0, 2), (1, None)])
    assert [v.item() for v in local] == [1.0, 1.0, 1.0]
    assert torch.stack(local).mean().item() == pytest.approx(1.0)   # pairwise mixing preserves the mean


def test_diloco_round_is_the_average_step():
    z = [torch.tensor([1.0, 1.0])] * 3
    y = [torch.tensor([0.0, 1.0]), torch.tensor([0.5, 1.0]), torch.tensor([1.0, 4.0])]
    opts = [OuterSGD(lr=1.0, momentum=0.0) for _ in z]
    new = outer_round(z, y, "diloco", opts, random.Random(0))
    for t in new:
        assert torch.allclose(t, torch.tensor([0.5, 2.0]))


def test_global_m1_keeps_local_outer_gradients():
    z = [torch.tensor([0.0]), torch.tensor([2.0])]
    y = [torch.tensor([1.0]), torch.tensor([2.0])]
    opts = [OuterSGD(lr=1.0, momentum=0.0) for _ in z]
    new = outer_round(z, y, "global_m1", opts, random.Random(0))
    # x = global mean 1.0; replica 0 adds its own Δ = +1, replica 1 adds 0.
    assert [t.item() for t in new] == [2.0, 1.0]


def test_all_variants_known():
    assert set(VARIANTS) == {"diloco", "global_m1", "global_m1_local_m2", "local_m1_m2"}


def test_replica_outer_step_is_what_outer_round_applies():
    # The worker's per-replica form (x from its Mix1, Δ̂ from its Mix2) gives the simulator's numbers.
    z = [torch.tensor([0.0, 1.0]), torch.tensor([2.0, -1.0])]
    y = [torch.tensor([0.5, 0.5]), torch.tensor([2.5, 0.0])]
    whole = outer_round(z, y, "global_m1_local_m2", [OuterSGD() for _ in z], random.Random(0))
    x = mix("global", z)
    deltas = mix("local", [end - start for start, end in zip(z, y)], [(0, 1)])
    for m in range(2):
        assert torch.equal(replica_outer_step(x[m], deltas[m], OuterSGD()), whole[m])
