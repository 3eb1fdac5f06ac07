"""A seeded pseudo-random permutation of [0, n), computed element-wise in O(1) memory.

Re-sharding deals document g (its position in the concatenated input) to shard ``p % S`` at place
``p // S`` with ``p = perm(g)``: shard sizes then differ by at most one input row, every shard is a
uniformly shuffled mix of all sources, and no process ever holds a permutation of the whole corpus
(FineWeb-Edu has over a billion documents). The permutation is a balanced Feistel network over the
smallest even power of two >= n, restricted to [0, n) by cycle-walking (a bijection on the larger
domain, re-applied to values that fall outside, is a bijection on [0, n)). Vectorised with numpy.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast 64-bit hash with full avalanche."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class Permutation:
    """perm(i) for i in [0, n): a bijection fixed by `seed` (and n)."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError("n must be positive")
        self.n = n
        bits = max(2, int(n - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        digest = hashlib.sha256(f"agoractl-permutation:{seed}:{n}".encode()).digest()
        self.keys = [np.uint64(int.from_bytes(digest[4 * r:4 * r + 8], "little")) for r in range(ROUNDS)]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        with np.errstate(over="ignore"):
            for k in self.keys:
                left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        out = self._feistel(np.asarray(idx, dtype=np.uint64))
        n = np.uint64(self.n)
        bad = out >= n
        while bad.any():  # the domain is < 4n, so a few walks at most on average
            out[bad] = self._feistel(out[bad])
            bad = out >= n
        return out.astype(np.int64)
