"""The Llama-style decoder, its stage partition, and the monolithic model (report §4.1, DESIGN §4).

Built from ``model.*`` of the manifest: RMSNorm, RoPE, grouped-query attention through
``scaled_dot_product_attention``, SwiGLU MLP, untied embedding and LM head. With ``model.ssn.rank``
set it is a reparameterized SSN: the attention and MLP output projections are ``Z U_kᵀ`` and the
token embedding is ``T_fixed + E U_kᵀ`` (:mod:`agoractl.model.subspace`), so each stage ships k
coordinates per token through the boundary codec (:mod:`agoractl.model.codec`), which runs
inside :meth:`LlamaStage.forward`: a worker only ever sees k-wide tensors.

- :func:`build_stage` materializes one stage from the manifest alone (head: embedding + blocks;
  body: blocks; tail: blocks + final norm + LM head); :func:`build_model` the whole model, whose
  state_dict keys are exactly the union of the stages' keys. Names use global block indices
  (``blocks.6.attn.wq.weight``); fixed buffers are ``persistent=False``.
- Every parameter is initialised from a generator seeded by (its name, ``training.seed``), so every
  replica of a stage starts identical and equal to the monolithic model's parameter of that name.
- Parameter counts equal :func:`agoractl.manifest.plan.stage_counts` (tests check it, on the meta
  device: ``build_stage(run, i, "meta")`` allocates nothing).

bf16: when ``training.precision`` is bf16 and the stage lives on CUDA, its forward runs under
bf16 autocast; the residual stream, the codec and the U_kᵀ expansions stay fp32.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from agoractl.manifest.schema import Model, Run
from agoractl.model.codec import BoundaryCodec
from agoractl.model.subspace import SubspaceEmbedding, SubspaceLinear, seeded_generator

_SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
AUTOCAST_DEVICES = ("cuda",)
"""Device types where ``training.precision: bf16`` turns on autocast (CPU bf16 is slow on most CPUs)."""


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).type_as(x)


def rope_tables(head_dim: int, length: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [length, head_dim/2], in fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    ang = torch.outer(torch.arange(length, dtype=torch.float64, device=device), inv)
    return ang.cos().float(), ang.sin().float()


class Rotary(nn.Module):
    """RoPE tables for model.seq_len positions (buffers, not persistent); longer inputs compute their own."""

    def __init__(self, m: Model):
        super().__init__()
        self.head_dim, self.length, self.theta = m.head_dim, m.seq_len, m.rope_theta
        self.register_buffer("cos", torch.empty(self.length, self.head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(self.length, self.head_dim // 2), persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        if self.cos.device.type == "meta":
            return
        cos, sin = rope_tables(self.head_dim, self.length, self.theta)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        if t <= self.length:
            return self.cos[:t], self.sin[:t]
        return rope_tables(self.head_dim, t, self.theta, self.cos.device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head ([B, H, T, hd]) by the position angles (Llama convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def _out_projection(in_features: int, m: Model) -> nn.Module:
    """An output projection into the residual stream: Z U_kᵀ under SSN, a dense Linear otherwise."""
    layer = SubspaceLinear(in_features, m.ssn.rank) if m.ssn.rank else nn.Linear(in_features, m.d_model, bias=False)
    layer.residual_out = True  # init: scaled like GPT-2's residual projections
    return layer


class Attention(nn.Module):
    def __init__(self, m: Model):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = m.n_heads, m.kv_heads, m.head_dim
        self.wq = nn.Linear(m.d_model, m.n_heads * m.head_dim, bias=False)
        self.wk = nn.Linear(m.d_model, m.kv_heads * m.head_dim, bias=False)
        self.wv = nn.Linear(m.d_model, m.kv_heads * m.head_dim, bias=False)
        self.wo = _out_projection(m.n_heads * m.head_dim, m)

    def forward(self, x, cos, sin, basis):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv == self.n_heads:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif _SDPA_GQA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            rep = self.n_heads // self.n_kv
            y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                               is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
        return self.wo(y, basis) if isinstance(self.wo, SubspaceLinear) else self.wo(y)


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, m: Model):
        super().__init__()
        self.w1 = nn.Linear(m.d_model, m.d_ff, bias=False)
        self.w3 = nn.Linear(m.d_model, m.d_ff, bias=False)
        self.w2 = _out_projection(m.d_ff, m)

    def forward(self, x, basis):
        h = F.silu(self.w1(x)) * self.w3(x)
        return self.w2(h, basis) if isinstance(self.w2, SubspaceLinear) else self.w2(h)


class Block(nn.Module):
    def __init__(self, m: Model):
        super().__init__()
        self.attn_norm = RMSNorm(m.d_model, m.norm_eps)
        self.attn = Attention(m)
        self.mlp_norm = RMSNorm(m.d_model, m.norm_eps)
        self.mlp = MLP(m)

    def forward(self, x, cos, sin, basis):
        x = x + self.attn(self.attn_norm(x), cos, sin, basis)
        return x + self.mlp(self.mlp_norm(x), basis)


class _Decoder(nn.Module):
    """The parts a piece of the decoder may own: embedding, blocks [start, stop), final norm + LM head."""

    def _build(self, run: Run, start: int, stop: int, embed: bool, lm_head: bool) -> None:
        m = run.model
        self.precision = run.training.precision
        self.codec = BoundaryCodec(m)
        self.rotary = Rotary(m)
        if embed:
            self.embed = SubspaceEmbedding(m.vocab_size, m.ssn.rank) if m.ssn.rank else nn.Embedding(m.vocab_size,
                                                                                                     m.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(m) for i in range(start, stop)})
        if lm_head:
            self.norm = RMSNorm(m.d_model, m.norm_eps)
            self.lm_head = nn.Linear(m.d_model, m.vocab_size, bias=False)

    def _autocast(self, device: torch.device):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                              enabled=self.precision == "bf16" and device.type in AUTOCAST_DEVICES)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, SubspaceEmbedding):
            return self.embed(tokens, self.codec.basis, self.codec.fixed_embedding)
        return self.embed(tokens).float()

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(x.shape[-2])
        for block in self.blocks.values():
            x = block(x, cos, sin, self.codec.basis)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


class StageModule(nn.Module):
    """One pipeline stage. ``forward(wire_in, tokens)``: head takes None and returns the wire;
    body maps wire → wire; tail maps wire → logits [B, T, V]; whole (the model not split) takes None and
    returns logits, never touching the SSN codec's encode/decode. The wire is fp32 [B, T, width]."""

    index: int
    role: str
    name: str
    embeds: bool
    """Owns the token embedding: takes token ids, no wire (head, whole)."""
    computes_loss: bool
    """Owns the final norm and LM head: returns logits (tail, whole)."""

    @property
    def wire_width(self) -> int:
        """Values per token on this stage's boundaries (k under SSN, d otherwise)."""
        raise NotImplementedError


class LlamaStage(StageModule, _Decoder):
    """Stage `index` of a Llama run, decoding its input and encoding its output with the SSN codec."""

    def __init__(self, run: Run, index: int):
        super().__init__()
        stage = run.stages[index]
        self.index, self.role, self.name = index, stage.role, run.stage_names()[index]
        self.embeds, self.computes_loss = stage.embeds, stage.computes_loss
        start, stop = run.layer_range(index)
        self._build(run, start, stop, embed=self.embeds, lm_head=self.computes_loss)

    @property
    def wire_width(self) -> int:
        return self.codec.width

    def hidden(self, wire_in: Optional[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """The d-wide residual stream after this stage's blocks (before encoding or the LM head)."""
        with self._autocast(tokens.device):
            if self.embeds:
                x = self._embed(tokens)
            else:
                if wire_in is None:
                    raise ValueError(f"stage {self.name} ({self.role}) needs the previous stage's wire tensor")
                x = self.codec.decode(wire_in, tokens)
            return self._blocks(x)

    def forward(self, wire_in: Optional[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        x = self.hidden(wire_in, tokens)
        if self.computes_loss:
            with self._autocast(tokens.device):
                return self._logits(x)
        return self.codec.encode(x, tokens)

    def extra_repr(self) -> str:
        return f"index={self.index}, role={self.role}, name={self.name}"


class LlamaModel(_Decoder):
    """The whole decoder in one module (the centralized reference); ``forward(tokens)`` → logits."""

    def __init__(self, run: Run):
        super().__init__()
        self._build(run, 0, run.model.n_layers, embed=True, lm_head=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with self._autocast(tokens.device):
            return self._logits(self._blocks(self._embed(tokens)))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; labels = the sample shifted by one (``s[:, 1:]``)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def split_sample(samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A LongTensor [B, seq_len + 1] → (inputs s[:, :-1], labels s[:, 1:])."""
    return samples[:, :-1], samples[:, 1:]


@torch.no_grad()
def greedy(model: nn.Module, prompt: list[int], n: int, eos: Optional[int] = None) -> list[int]:
    """Greedy decoding with the monolithic model: up to `n` tokens after `prompt` (each step re-reads
    the last ``seq_len`` tokens; no cache), stopping after `eos`."""
    ids = list(prompt)
    length = model.rotary.length
    out: list[int] = []
    for _ in range(n):
        logits = model(torch.tensor([ids[-length:]], dtype=torch.long))
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        ids.append(nxt)
        if nxt == eos:
            break
    return out


# ---- initialisation -------------------------------------------------------------------------------

def _init_std(module: nn.Module, m: Model) -> float:
    """Normal init std of a weight; reparameterized weights are scaled by sqrt(d/k) so that W = Z U_kᵀ
    (and E U_kᵀ) start with the same row norms as their dense counterparts."""
    std = m.init_std
    if getattr(module, "residual_out", False):
        std /= math.sqrt(2 * m.n_layers)
    if isinstance(module, (SubspaceLinear, SubspaceEmbedding)):
        std *= math.sqrt(m.d_model / module.rank)
    return std


@torch.no_grad()
def initialize_(module: nn.Module, run: Run) -> nn.Module:
    """Fill every parameter from a generator seeded by (its full name, training.seed), and rebuild
    the fixed buffers from model.ssn.seed. The result depends on names only, not on which other
    parameters the module holds, so stages and the monolithic model agree name by name."""
    m, seed = run.model, run.training.seed
    for mod_name, mod in module.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(mod, RMSNorm):
                p.fill_(1.0)
            elif p_name == "bias":
                p.zero_()
            else:
                g = seeded_generator(name, seed)
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * _init_std(mod, m))
        if hasattr(mod, "reset_buffers"):
            mod.reset_buffers()
    return module
