"""Validation of what a node receives (report §3.3.1.6, §3.3.2.3, §3.6.2): a faulty or hostile node
cannot take honest ones down.

Pure rules, no networking and no clock of their own; the runtime wires them in:

- a **worker** checks every request before it computes (:func:`request_problem`): token ids in the
  vocabulary, wire tensors and output gradients finite, in a wire dtype, of the right rank; a bad
  request is refused with an error naming the problem, and never reaches the stage's gradients —
  so the ``nan_gradients`` rule fires only for values the worker produced itself from valid inputs;
- a **trainer** checks every stage output, input gradient and loss it gets back
  (:func:`check_tensor`, :class:`NormTracker`, :func:`check_losses`): finite, the shape and dtype the
  stage promises, and a magnitude within ``validation.norm_multiple`` times the median of the
  stage's recent per-sample RMS (after ``validation.warmup`` accepted samples; a median is robust to
  the odd bad value it may have let in before); losses finite, non-negative and at most
  ``validation.loss_multiple`` × ln(vocab_size) — the loss of a uniform guess is ln(vocab_size),
  so a freshly initialised model's large losses pass;
- an **averaging** participant checks every part it receives (:func:`part_problem` at a reducer,
  :func:`update_mask` for what comes back): a non-finite part, or one larger than
  ``validation.part_multiple`` times the RMS of this peer's own values, is dropped like a missing one.

A rejected value is attributed to the node that produced it: :class:`FaultBook` counts faults per
node and reason (the run report's ``faults``) and says how long to ban it (``validation.fault_ban_s``,
longer than an ordinary failure's ``trainers.ban_s``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Optional, Sequence

import torch

from agoractl.manifest.schema import Run

REASONS = ("non_finite", "shape", "dtype", "magnitude", "loss")
"""Why a value is rejected (the keys of the run report's fault counts)."""
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Dtypes a boundary tensor may travel in (as :data:`agoractl.model.codec.WIRE_DTYPES`)."""
ID_DTYPES = (torch.int32, torch.int64)
RMS_FLOOR = 1e-12
"""Least RMS a bound is derived from (an all-zero history must not reject every non-zero value)."""


class Invalid(ValueError):
    """A received value failed a check: `reason` is one of :data:`REASONS`; the message names the value."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def rms_per_sample(t: torch.Tensor) -> list[float]:
    """Root mean square of each sample (first dimension) of `t`, in fp32: one norm and one transfer to
    Python (a check runs between compute steps, with cold caches: every extra operation counts)."""
    if t.dim() == 0 or t.shape[0] == 1:  # one sample (the report's default): the norm of all of it
        n = t.numel()
        norm = (torch.linalg.vector_norm(t) if t.dtype == torch.float32 else
                torch.linalg.vector_norm(t, dtype=torch.float32)) if n else 0.0
        return [float(norm) / math.sqrt(max(1, n))]
    if t.numel() == 0:
        return [0.0] * t.shape[0]
    per = t.numel() // t.shape[0]
    norms = torch.linalg.vector_norm(t.reshape(t.shape[0], per), dim=1, dtype=torch.float32).tolist()
    scale = 1.0 / math.sqrt(max(1, per))
    return [v * scale for v in norms]


def _non_finite(name: str, t: torch.Tensor) -> Invalid:
    bad = int((~torch.isfinite(t)).sum())
    return Invalid("non_finite", f"{name} holds {bad} non-finite value(s) (NaN or inf) of {t.numel()}")


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite: one sum on the fast path (NaN and inf propagate through
    it), an element-wise check only when the sum is not finite (it may have overflowed)."""
    if not t.is_floating_point():
        return True
    if math.isfinite(float(t.sum() if t.dtype == torch.float32 else t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


def check_tensor(name: str, t, shape: Optional[Sequence[Optional[int]]] = None,
                 dtypes: Sequence[torch.dtype] = tuple(WIRE_DTYPES.values()), finite: bool = True) -> None:
    """Raise :class:`Invalid` unless `t` is a tensor of one of `dtypes`, of `shape` (None: any size on
    that axis), with finite values only (unless `finite` is False: the caller checks them)."""
    if not isinstance(t, torch.Tensor):
        raise Invalid("shape", f"{name} is missing or not a tensor")
    if t.dtype not in dtypes:
        raise Invalid("dtype", f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected "
                               f"{' or '.join(str(d).replace('torch.', '') for d in dtypes)}")
    if shape is not None and (t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape))):
        want = tuple("*" if s is None else s for s in shape)
        raise Invalid("shape", f"{name} has shape {tuple(t.shape)}; expected {want}")
    if finite and not all_finite(t):
        raise _non_finite(name, t)


def request_problem(method: str, ids, wire, grad, vocab_size: int, needs_wire: bool) -> Optional[str]:
    """What is wrong with a stage request, in one line; None when the worker may compute it.

    `ids` [b, seq_len+1] token ids; `wire` the stage input [b, seq_len, width] (required when
    `needs_wire`); `grad` the gradient of the stage output (backward only)."""
    try:
        check_tensor("ids", ids, (None, None), ID_DTYPES)
        if ids.numel() and not torch.equal(ids.clamp(0, vocab_size - 1), ids):  # 2 operations, no transfer
            raise Invalid("shape", f"ids hold token ids outside [0, {vocab_size})")
        if needs_wire:
            check_tensor("wire", wire, (ids.shape[0], ids.shape[1] - 1, None))
        if method == "backward":
            check_tensor("grad", grad, (ids.shape[0], ids.shape[1] - 1, None))
    except Invalid as e:
        return str(e)
    return None


class NormTracker:
    """Recent per-sample RMS of one kind of value (a stage's outputs, or its input gradients) and the
    bound it implies: `multiple` × their median, once `warmup` values were accepted (None before)."""

    def __init__(self, multiple: float, window: int = 64, warmup: int = 8):
        self.multiple, self.warmup = float(multiple), int(warmup)
        self.recent: deque[float] = deque(maxlen=max(1, int(window)))
        self._bound: Optional[float] = None
        self._stale = True

    def bound(self) -> Optional[float]:
        if self._stale:
            enough = len(self.recent) >= self.warmup
            self._bound = self.multiple * max(median(self.recent), RMS_FLOOR) if enough else None
            self._stale = False
        return self._bound

    def check(self, name: str, t: torch.Tensor) -> list[float]:
        """Raise :class:`Invalid` if `t` holds a non-finite value or a sample above the bound; else the
        per-sample RMS values (pass them to :meth:`observe` once the whole reply is accepted)."""
        values = rms_per_sample(t)
        worst = max(values, default=0.0)
        if not math.isfinite(worst) or any(v != v for v in values):  # NaN or inf inside, or an overflow
            if not bool(torch.isfinite(t).all()):
                raise _non_finite(name, t)
            raise Invalid("magnitude", f"{name} has values too large for an RMS in fp32")
        bound = self.bound()
        if bound is not None and worst > bound:
            raise Invalid("magnitude", f"{name} has RMS {worst:.3g}, above {self.multiple:g} x the stage's recent "
                                       f"median ({bound / self.multiple:.3g})")
        return values

    def observe(self, values: Sequence[float]) -> None:
        self.recent.extend(values)
        self._stale = True


def loss_bound(vocab_size: int, multiple: float) -> float:
    """Largest per-sample loss accepted: `multiple` × ln(vocab_size) (a uniform guess scores ln V)."""
    return float(multiple) * math.log(max(2, vocab_size))


def check_losses(losses, n: int, vocab_size: int, multiple: float) -> None:
    """Raise :class:`Invalid` unless `losses` holds `n` finite per-sample losses in [0, loss_bound]."""
    check_tensor("loss", losses, None, (torch.float32, torch.float64, torch.bfloat16, torch.float16), finite=False)
    values = (losses if losses.dim() == 1 else losses.reshape(-1)).tolist()  # a few numbers: checked in Python
    if len(values) != n:
        raise Invalid("shape", f"loss has {len(values)} value(s) for {n} sample(s)")
    bad = sum(not math.isfinite(v) for v in values)
    if bad:
        raise Invalid("non_finite", f"loss holds {bad} non-finite value(s) (NaN or inf) of {n}")
    top = loss_bound(vocab_size, multiple)
    low, high = min(values, default=0.0), max(values, default=0.0)
    if low < -1e-4 or high > top:
        raise Invalid("loss", f"loss {high if high > top else low:.4g} is outside [0, {top:.4g}] "
                              f"({multiple:g} x ln(vocab_size))")


def rms(t: torch.Tensor) -> float:
    """Root mean square of all of `t` (0 for an empty tensor)."""
    return float(t.detach().float().pow(2).mean().sqrt()) if t.numel() else 0.0


def part_problem(part: torch.Tensor, reference_rms: Optional[float], multiple: float) -> Optional[str]:
    """Why an averaging part from a groupmate must be dropped, or None: non-finite values, or an RMS above
    `multiple` × `reference_rms` (the RMS of this peer's own values; None: only finiteness is checked)."""
    if not all_finite(part):
        return "part holds non-finite values"
    if reference_rms is not None and reference_rms > RMS_FLOOR:  # all-zero values of ours bound nothing
        got = rms(part)
        if got > multiple * reference_rms:
            return f"part has RMS {got:.3g}, above {multiple:g} x this peer's {reference_rms:.3g}"
    return None


def update_mask(update: torch.Tensor, local: torch.Tensor, multiple: float) -> torch.Tensor:
    """Which values of an averaged update (average − local) to apply: finite, and no larger than
    `multiple` × the RMS of this peer's `local` values (the rest count as not averaged)."""
    ref = rms(local)
    if ref <= RMS_FLOOR:  # all-zero values of ours bound nothing: finiteness only
        return torch.isfinite(update)
    return torch.isfinite(update) & (update.abs() <= multiple * ref)


@dataclass
class FaultBook:
    """Faults attributed to nodes, and how long each is banned for them (``fault_ban_s``, doubling with
    every repeat up to ``max_ban_s``)."""

    fault_ban_s: float
    max_ban_s: float = 24 * 3600.0
    counts: dict = field(default_factory=dict)
    """{peer: {"stage": stage, reason: count, ...}}"""

    def record(self, peer: str, stage: str, reason: str) -> float:
        """Count one fault of `peer` (a worker of `stage`); returns the ban in seconds."""
        entry = self.counts.setdefault(peer, {"stage": stage})
        entry[reason] = entry.get(reason, 0) + 1
        repeats = sum(v for k, v in entry.items() if k != "stage")
        return min(self.max_ban_s, self.fault_ban_s * 2 ** (repeats - 1))

    def total(self, peer: str) -> int:
        return sum(v for k, v in self.counts.get(peer, {}).items() if k != "stage")


class ReplyChecks:
    """A trainer's checks of every reply (report §3.3.2.3): what each stage promises, per the manifest.

    forward: ``wire`` [n, seq_len, width] in ``workers.wire_dtype``, finite, per-sample RMS within the
    stage's output bound; forward_backward: ``loss`` [n] finite in [0, loss bound], and ``grad``
    shaped like the wire sent, finite, within the stage's gradient bound; backward: ``grad`` likewise
    (none from the head); every reply's ``step`` an integer in [0, training.max_steps]. Trackers learn
    only from replies accepted whole."""

    def __init__(self, run: Run):
        v = run.validation
        self.run, self.v = run, v
        self.width = run.model.ssn.rank or run.model.d_model
        self.dtype = WIRE_DTYPES[run.workers.wire_dtype]
        self.trackers: dict[tuple[str, str], NormTracker] = {}

    def tracker(self, stage: str, kind: str) -> NormTracker:
        key = (stage, kind)
        if key not in self.trackers:
            self.trackers[key] = NormTracker(self.v.norm_multiple, self.v.norm_window, self.v.warmup)
        return self.trackers[key]

    def check(self, stage: str, method: str, sent: dict, out: dict, meta: dict) -> None:
        """Raise :class:`Invalid` naming the first problem of the reply `out`/`meta` to request `sent`."""
        ids = sent["ids"]
        n, length = int(ids.shape[0]), int(ids.shape[1]) - 1
        accepted: list[tuple[NormTracker, list[float]]] = []
        if method == "forward":
            check_tensor("output wire", out.get("wire"), (n, length, self.width), (self.dtype,), finite=False)
            tracker = self.tracker(stage, "output")
            accepted.append((tracker, tracker.check("output wire", out["wire"])))
        if method == "forward_backward":
            check_losses(out.get("loss"), n, self.run.model.vocab_size, self.v.loss_multiple)
        if method in ("backward", "forward_backward") and sent.get("wire") is not None:
            check_tensor("input gradient", out.get("grad"), tuple(sent["wire"].shape), (self.dtype,), finite=False)
            tracker = self.tracker(stage, "grad")
            accepted.append((tracker, tracker.check("input gradient", out["grad"])))
        step = meta.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= self.run.training.max_steps:
            raise Invalid("shape", f"reply names step {step!r}, outside [0, training.max_steps]")
        for tracker, values in accepted:
            tracker.observe(values)
