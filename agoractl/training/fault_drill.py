"""Fault drills: make a real worker faulty on purpose (``agoractl launch worker --fault KIND``, hidden),
so tests and operators can see the swarm survive a broken GPU, a bad driver or a hostile node
(report §3.3.1.6, §3.6.2). The worker stays an ordinary agoractl worker otherwise: it announces,
serves, steps and averages; only the values it produces are wrong, from its :data:`ONSET` th computed
batch on (a device that goes bad mid-run: trainers have seen normal values from it first).

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
ONSET = 4
"""Batches a drilled worker computes correctly before its values go wrong."""


def corrupt_results(fault: Optional[str], method: str, results: list[dict], params: Iterable["torch.Tensor"],
                    computed: int = ONSET) -> None:
    """Apply `fault` to one computed batch, in place: its replies `results` and the stage's `params` grads;
    `computed`: batches the worker computed before this one (nothing happens before :data:`ONSET`)."""
    if computed < ONSET:
        return
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
