"""The seeded element-wise permutation behind re-sharding (agoractl.data.permutation). In-memory."""

from __future__ import annotations

import numpy as np
import pytest

from agoractl.data.permutation import Permutation


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097, 100_003])
def test_bijection_on_0_n(n):
    out = Permutation(n, seed=11)(np.arange(n))
    assert out.dtype == np.int64 and np.array_equal(np.sort(out), np.arange(n))


def test_seeded_elementwise_and_chunk_independent():
    p = Permutation(10_000, seed=0)
    whole = p(np.arange(10_000))
    assert np.array_equal(np.concatenate([p(np.arange(0, 3000)), p(np.arange(3000, 10_000))]), whole)
    assert np.array_equal(Permutation(10_000, seed=0)(np.arange(10_000)), whole)
    assert not np.array_equal(Permutation(10_000, seed=1)(np.arange(10_000)), whole)


def test_dealing_is_balanced_and_mixed():
    n, shards = 20_000, 16
    p = Permutation(n, seed=5)(np.arange(n))
    counts = np.bincount(p % shards, minlength=shards)
    assert counts.max() - counts.min() <= 1
    # consecutive inputs scatter: the first 1,000 documents reach every shard
    assert len(np.unique(p[:1000] % shards)) == shards
    # no strong linear relation between position and permuted position
    assert abs(np.corrcoef(np.arange(n), p)[0, 1]) < 0.05
