"""The surrogate model family (report §3.5.1.1): linear stand-ins for transformer blocks.

For fast system tests on CPU: every block is a residual ``Linear(d, d)`` (with bias); the head
embeds tokens, the tail projects to the vocabulary. The step time is controlled by delays
injected into every forward and backward pass (``model.surrogate.forward_delay_ms`` /
``backward_delay_ms``), and ``model.surrogate.dummy_params`` extra parameters per stage inflate the
averaging payload without taking part in compute (they get no gradient). Activations on the wire
have the real shape ``[B, seq_len, d_model]``, so the pipeline moves the bytes a real model would
with dense boundaries.

Names: ``embed.weight``, ``blocks.<global index>.linear.{weight,bias}``, ``lm_head.weight``,
``dummy.<stage index>``; the monolithic :class:`SurrogateModel` holds the union.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

from agoractl.manifest.schema import Run
from agoractl.model.llama import StageModule


class _BackwardDelay(torch.autograd.Function):
    """Identity whose backward sleeps: the surrogate's backward-pass cost."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SurrogateBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x)


class _SurrogateParts(nn.Module):
    def _build(self, run: Run, start: int, stop: int, embed: bool, lm_head: bool, dummies: list[int]) -> None:
        m = run.model
        self.d_model = m.d_model
        self.forward_delay_s = m.surrogate.forward_delay_ms / 1000.0
        self.backward_delay_s = m.surrogate.backward_delay_ms / 1000.0
        if embed:
            self.embed = nn.Embedding(m.vocab_size, m.d_model)
        self.blocks = nn.ModuleDict({str(i): SurrogateBlock(m.d_model) for i in range(start, stop)})
        if lm_head:
            self.lm_head = nn.Linear(m.d_model, m.vocab_size, bias=False)
        if m.surrogate.dummy_params:
            self.dummy = nn.ParameterDict({str(i): nn.Parameter(torch.empty(m.surrogate.dummy_params))
                                           for i in dummies})

    def _delayed(self, x: torch.Tensor, passes: int = 1) -> torch.Tensor:
        """Sleep for the forward delay now and arrange the backward delay, `passes` times over."""
        if self.forward_delay_s:
            time.sleep(self.forward_delay_s * passes)
        if self.backward_delay_s and x.requires_grad:
            x = _BackwardDelay.apply(x, self.backward_delay_s * passes)
        return x


class SurrogateStage(StageModule, _SurrogateParts):
    """Stage `index` of a surrogate run; same forward contract as a Llama stage, wire [B, T, d]."""

    def __init__(self, run: Run, index: int):
        super().__init__()
        stage = run.stages[index]
        self.index, self.role, self.name = index, stage.role, run.stage_names()[index]
        self.embeds, self.computes_loss = stage.embeds, stage.computes_loss
        start, stop = run.layer_range(index)
        self._build(run, start, stop, embed=self.embeds, lm_head=self.computes_loss, dummies=[index])

    @property
    def wire_width(self) -> int:
        return self.d_model

    def forward(self, wire_in: Optional[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        if self.embeds:
            x = self.embed(tokens)
        else:
            if wire_in is None:
                raise ValueError(f"stage {self.name} ({self.role}) needs the previous stage's wire tensor")
            x = wire_in.float()
        for block in self.blocks.values():
            x = block(x)
        if self.computes_loss:
            x = self.lm_head(x)
        return self._delayed(x)

    def extra_repr(self) -> str:
        return f"index={self.index}, role={self.role}, name={self.name}"


class SurrogateModel(_SurrogateParts):
    """The whole surrogate in one module; pays every stage's delays, like the pipeline would."""

    def __init__(self, run: Run):
        super().__init__()
        self.n_stages = len(run.stages)
        self._build(run, 0, run.model.n_layers, embed=True, lm_head=True, dummies=list(range(self.n_stages)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks.values():
            x = block(x)
        return self._delayed(self.lm_head(x), passes=self.n_stages)
