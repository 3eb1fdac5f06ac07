"""The fixed subspace of a reparameterized SSN (report §4.1): U_k, T_fixed, and the Z @ U_kᵀ layers.

Every stage of a run rebuilds the same orthonormal basis ``U_k`` (d×k) and the same fixed token
embedding ``T_fixed`` (V×d) from ``model.ssn.seed``; nothing is broadcast. The attention and MLP
output projections are :class:`SubspaceLinear` (``W = Z U_kᵀ``, Z trainable) and the trainable
token embedding is ``E U_kᵀ``, so every contribution to the residual stream lies in span(U_k) and
the boundary codec (:mod:`agoractl.model.codec`) can ship k coordinates per token losslessly.

The ``U_kᵀ`` expansion always runs in fp32, outside any autocast: rounding a d-wide product to
bf16 would push it slightly out of the subspace, and the codec would then drop that part.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.nn import functional as F


def seeded_generator(tag: str, seed: int) -> torch.Generator:
    """A CPU generator whose stream depends only on (tag, seed): the same in every process."""
    return torch.Generator(device="cpu").manual_seed((zlib.crc32(tag.encode()) + 1_000_003 * seed) % (2**63))


def orthonormal_basis(d: int, k: int, seed: int) -> torch.Tensor:
    """U_k: a d×k matrix with orthonormal columns, a function of (d, k, seed) only.

    QR of a seeded Gaussian in float64 on the CPU, with the signs fixed (diag R > 0) so that the
    result does not depend on the LAPACK build's sign convention; returned as fp32.
    """
    g = seeded_generator("ssn.basis", seed)
    q, r = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(k, dtype=torch.float64))
    return q.to(torch.float32).contiguous()


def fixed_token_embedding(vocab: int, d: int, seed: int, std: float) -> torch.Tensor:
    """T_fixed: a V×d Gaussian table (std `std`), a function of (V, d, seed, std) only; never trained."""
    g = seeded_generator("ssn.fixed_embedding", seed)
    return (torch.randn(vocab, d, generator=g, dtype=torch.float32) * std).contiguous()


def expand(coords: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """coords @ U_kᵀ in fp32, outside autocast (k-wide → d-wide, stays exactly in the subspace)."""
    with torch.autocast(device_type=coords.device.type, enabled=False):
        return coords.float() @ basis.t()


class SubspaceLinear(nn.Module):
    """An output projection W = Z U_kᵀ (report eq. 3): ``weight`` holds Zᵀ, shape [k, in_features].

    ``forward(x, basis)`` = (x Z) U_kᵀ; the gradient reaching Z is (∇_W L) U_k by the chain rule,
    so the optimizer needs no special handling. U_k is passed in (one buffer per stage, owned by
    the stage's codec) rather than stored here, so a stage holds it once.
    """

    def __init__(self, in_features: int, rank: int):
        super().__init__()
        self.in_features, self.rank = in_features, rank
        self.weight = nn.Parameter(torch.empty(rank, in_features))

    def forward(self, x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        return expand(F.linear(x, self.weight), basis)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, rank={self.rank}"


class SubspaceEmbedding(nn.Module):
    """The token embedding T_fixed[tokens] + E[tokens] U_kᵀ; ``weight`` is E, shape [V, k].

    T_fixed and U_k are passed in (owned by the stage's codec, which subtracts the same T_fixed).
    """

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.vocab, self.rank = vocab, rank
        self.weight = nn.Parameter(torch.empty(vocab, rank))

    def forward(self, tokens: torch.Tensor, basis: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
        return fixed[tokens] + expand(F.embedding(tokens, self.weight), basis)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab}, rank={self.rank}"
