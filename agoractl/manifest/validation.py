"""The manifest's ``validation`` section: what trainers, workers and averaging participants check in what they
receive (report §3.3.1.6, §3.3.2.3; the checks themselves are :mod:`agoractl.algorithms.validation`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Validation(BaseModel):
    """Checks on what nodes receive (:mod:`agoractl.algorithms.validation`): a faulty node is banned, not obeyed."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    enabled: bool = True
    """Check stage outputs, gradients and losses at trainers, requests at workers, parts in averaging."""
    norm_multiple: float = Field(100.0, gt=1)
    """Reject a stage output or gradient whose per-sample RMS exceeds this many times the highest median of the
    stage's recent values (the bound does not shrink as the model learns)."""
    norm_window: int = Field(64, gt=0)
    """Recent accepted samples (per stage and kind) the median is taken over."""
    warmup: int = Field(8, ge=1)
    """Accepted samples per stage and kind before the magnitude bound applies (finiteness always does)."""
    early_multiple: float = Field(10000.0, gt=1)
    """The multiple of the bound (never below norm_multiple) until norm_window samples per stage and kind were
    accepted: early in training a stage's values grow over 100x within a few steps; a x1e6 value is still refused."""
    loss_multiple: float = Field(10.0, gt=1)
    """Reject a per-sample loss above this many times ln(model.vocab_size) (a uniform guess's loss)."""
    part_multiple: float = Field(10.0, gt=0)
    """Drop an averaging part further from this peer's values than this many times their RMS."""
    fault_ban_s: float = Field(600.0, ge=0)
    """Seconds a worker whose output was rejected stays banned (doubling on every repeat); trainers.ban_s is
    for ordinary failures."""
