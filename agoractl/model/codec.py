"""The boundary codec of a reparameterized SSN (report §4.1, eq. 2) and the wire dtypes.

What crosses a stage boundary is ``(X − T_fixed[tokens]) U_k`` — n×k coordinates — plus the token
ids, and the receiver rebuilds ``X = T_fixed[tokens] + coords U_kᵀ`` exactly (the residual stream
lies in span(U_k) plus the fixed embedding by construction; there is no additive positional
embedding to subtract, positions enter through RoPE inside attention). The backward pass uses the
same compression: autograd through ``decode`` turns a d-wide gradient into ``∇X U_k`` (k-wide).

Both sides rebuild U_k and T_fixed from ``model.ssn.seed``; the codec is a module only so its
buffers follow ``.to(device)``, and they are ``persistent=False`` (never in a state_dict).
With ``model.ssn.rank: null`` the codec is the identity and the wire is d-wide.

On the network a wire tensor may be fp32, bf16 or fp16: :func:`to_wire` / :func:`from_wire`.
Inside a stage it is always fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from agoractl.manifest.schema import Model
from agoractl.model.subspace import expand, fixed_token_embedding, orthonormal_basis

WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Dtypes a boundary tensor (activation or gradient) may travel in."""


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of wire dtype `name` (fp32, bf16, fp16); ValueError naming the choices otherwise."""
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown wire dtype {name!r}; choose one of {', '.join(WIRE_DTYPES)}") from None


def to_wire(t: torch.Tensor, dtype: str = "fp32") -> torch.Tensor:
    """A boundary tensor as sent: detached, contiguous, on the CPU, cast to `dtype`."""
    return t.detach().to(device="cpu", dtype=wire_dtype(dtype)).contiguous()


def from_wire(t: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """A received boundary tensor back in fp32 on `device` (what a stage's forward takes)."""
    return t.to(device=device, dtype=torch.float32)


class BoundaryCodec(nn.Module):
    """encode (X, tokens) → coords [.., k] and decode (coords, tokens) → X [.., d]; token ids travel beside.

    Owns the stage's fixed buffers ``basis`` (U_k, d×k) and ``fixed_embedding`` (T_fixed, V×d);
    the head's embedding and every :class:`~agoractl.model.subspace.SubspaceLinear` use them.
    """

    def __init__(self, m: Model):
        super().__init__()
        self.d_model, self.vocab_size = m.d_model, m.vocab_size
        self.rank: Optional[int] = m.ssn.rank
        # T_fixed is drawn like an ordinary embedding table, with the model's init_std.
        self.seed, self.fixed_std = m.ssn.seed, m.init_std
        self.basis: Optional[torch.Tensor]
        self.fixed_embedding: Optional[torch.Tensor]
        if self.rank is None:
            self.basis = self.fixed_embedding = None
        else:
            self.register_buffer("basis", torch.empty(self.d_model, self.rank), persistent=False)
            self.register_buffer("fixed_embedding", torch.empty(self.vocab_size, self.d_model), persistent=False)

    @property
    def width(self) -> int:
        """Values per token on the wire: k under SSN, d for dense boundaries."""
        return self.rank or self.d_model

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """(Re)build U_k and T_fixed from the seed, in place, on whatever device the buffers live."""
        if self.rank is None or self.basis.device.type == "meta":
            return
        self.basis.copy_(orthonormal_basis(self.d_model, self.rank, self.seed))
        self.fixed_embedding.copy_(fixed_token_embedding(self.vocab_size, self.d_model, self.seed, self.fixed_std))

    def encode(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(X − T_fixed[tokens]) U_k in fp32: the coordinates sent downstream (X itself when dense)."""
        if self.rank is None:
            return x.float()
        with torch.autocast(device_type=x.device.type, enabled=False):
            return (x.float() - self.fixed_embedding[tokens]) @ self.basis

    def decode(self, coords: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """T_fixed[tokens] + coords U_kᵀ in fp32: the residual stream rebuilt (coords itself when dense)."""
        if self.rank is None:
            return coords.float()
        return self.fixed_embedding[tokens] + expand(coords, self.basis)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, rank={self.rank}, seed={self.seed}"
