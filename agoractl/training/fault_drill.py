"""Fault drills: make a real worker faulty on purpose (``agoractl launch worker --fault KIND``, hidden),
so tests and operators can see the swarm survive a broken GPU, a bad driver or a hostile node
(report §3.3.1.6, §3.6.2). The worker stays an ordinary agoractl worker otherwise: it announces,
serves, steps and averages; only the values it produces are wrong.

==================== =====================================================================
kind                 what the worker does
==================== =====================================================================
nan-outputs          every forward output (the wire sent downstream) is NaN
huge-outputs         every forward output is finite but multiplied by 1e6
nan-grads            every backward's results are NaN: the input gradient it returns, the
                     tail's losses, and its own parameter gradients (so its own
                     ``nan_gradients`` rule fires at its next step, as on a broken GPU)
nan-parts            its values in every averaging round (SPARTA) are NaN
huge-parts           its values in every averaging round are multiplied by 1e6
==================== =====================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

if TYPE_CHECKING:  # tensor methods only: the CLI checks --fault before torch is imported
    import torch

FAULTS = ("nan-outputs", "huge-outputs", "nan-grads", "nan-parts", "huge-parts")
HUGE = 1e6


def corrupt_results(fault: Optional[str], method: str, results: list[dict], params: Iterable["torch.Tensor"]) -> None:
    """Apply `fault` to one computed batch, in place: its replies `results` and the stage's `params` grads."""
    if fault in ("nan-outputs", "huge-outputs") and method == "forward":
        for r in results:
            r["wire"] = r["wire"] * HUGE if fault == "huge-outputs" else r["wire"].new_full(r["wire"].shape, float("nan"))
    elif fault == "nan-grads" and method != "forward":
        for r in results:
            for k in ("grad", "loss"):
                if r.get(k) is not None:
                    r[k] = r[k].new_full(r[k].shape, float("nan"))
        for p in params:
            if p.grad is not None:
                p.grad.fill_(float("nan"))


def corrupt_part(fault: Optional[str], values: "torch.Tensor") -> "torch.Tensor":
    """The values this worker sends in an averaging round under `fault` (a copy; `values` unchanged)."""
    if fault == "nan-parts":
        return values.new_full(values.shape, float("nan"))
    if fault == "huge-parts":
        return values * HUGE
    return values
