"""Validation of what a node receives (report §3.3.1.6, §3.3.2.3, §3.6.2): a faulty or hostile node
cannot take honest ones down.

Pure rules, no networking and no clock of their own; the runtime wires them in:

- a **worker** checks every request before it computes (:func:`request_problem`): token ids in the
  vocabulary, wire tensors and output gradients finite, in a wire dtype, of the right rank; a bad
  request is refused with an error naming the problem, and never reaches the stage's gradients —
  so the ``nan_gradients`` rule fires only for values the worker produced itself from valid inputs.
  A backward's ids and wire are checked when they are used: a worker whose activation cache serves the
  backward runs it on the graph of the forward it checked (same ids and wire: the cache's key is their
  digest) and never reads the request's copies; one that recomputes checks them first (:func:`inputs_problem`);
- a **trainer** checks every stage output, input gradient and loss it gets back
  (:func:`check_tensor`, :class:`NormTracker`, :func:`check_losses`): finite, the shape and dtype the
  stage promises, and a magnitude within ``validation.norm_multiple`` times the highest median the
  stage's recent per-sample RMS has had (after ``validation.warmup`` accepted samples; a median is
  robust to the odd bad value it may have let in before; ``validation.early_multiple`` times it until
  ``validation.norm_window`` samples were accepted, while honest values still grow a hundredfold in a few
  steps); losses finite, non-negative and at most
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
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from agoractl.manifest.schema import Run

REASONS = ("non_finite", "shape", "dtype", "magnitude", "loss")
"""Why a value is rejected (the keys of the run report's fault counts)."""
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Dtypes a boundary tensor may travel in (as :data:`agoractl.model.codec.WIRE_DTYPES`)."""
ID_DTYPES = (torch.int32, torch.int64)
_WIRE_DTYPE_SET, _ID_DTYPE_SET = frozenset(WIRE_DTYPES.values()), frozenset(ID_DTYPES)
LOSS_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_LOSS_DTYPE_SET = frozenset(LOSS_DTYPES)
RMS_FLOOR = 1e-12
"""Least RMS a bound is derived from (an all-zero history must not reject every non-zero value)."""


class Invalid(ValueError):
    """A received value failed a check: `reason` is one of :data:`REASONS`; the message names the value."""

    def __init__(self, reason: str, message: str, attributable: bool = True):
        super().__init__(message)
        self.reason, self.attributable = reason, attributable
        """False: the value may be bad because of what the node was sent, not what it did (no fault of its own)."""


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


def request_problem(method: str, ids, wire, grad, vocab_size: int, needs_wire: bool,
                    deferred: bool = False) -> Optional[str]:
    """What is wrong with a stage request, in one line; None when the worker may compute it.

    `ids` [b, seq_len+1] token ids; `wire` the stage input [b, seq_len, width] (required when
    `needs_wire`); `grad` the gradient of the stage output (backward only). A valid request costs its
    structure in Python and one ``aminmax`` per tensor (the same operation for each: what a check costs
    between compute steps is mostly the number of distinct operations it runs); only a request that
    fails is checked again value by value, to name the problem.

    `deferred` (a backward to a worker with an activation cache): the values of `ids` and `wire` are not
    checked here — only their structure — but by :func:`inputs_problem` when the backward is not served
    by the cache; a backward it serves runs on the graph of a forward whose identical ids and wire (the
    cache's key is their digest) this worker checked already, and does not use the request's copies."""
    backward = method == "backward"
    # the fast path, inline (a function call per check counts: see rms_per_sample)
    if (type(ids) is torch.Tensor and ids.dtype in _ID_DTYPE_SET and ids.dim() == 2
            and (not needs_wire or _fits(wire, ids)) and (not backward or _fits(grad, ids))):
        if deferred and backward:
            if grad.numel() == 0 or _finite(grad):
                return None
        elif ((ids.numel() == 0 or _ids_in_range(ids, vocab_size))
                and (not needs_wire or wire.numel() == 0 or _finite(wire))
                and (not backward or grad.numel() == 0 or _finite(grad))):
            return None
    try:
        check_tensor("ids", ids, (None, None), ID_DTYPES)
        if ids.numel() and not (deferred and backward) and not torch.equal(ids.clamp(0, vocab_size - 1), ids):
            raise Invalid("shape", f"ids hold token ids outside [0, {vocab_size})")
        if needs_wire:
            check_tensor("wire", wire, (ids.shape[0], ids.shape[1] - 1, None), finite=not (deferred and backward))
        if backward:
            check_tensor("grad", grad, (ids.shape[0], ids.shape[1] - 1, None))
    except Invalid as e:
        return str(e)
    return None


def inputs_problem(ids, wire, vocab_size: int, needs_wire: bool) -> Optional[str]:
    """The values check :func:`request_problem` defers (ids in the vocabulary, the wire finite), for a
    request whose structure it accepted; None when they are valid."""
    return request_problem("forward", ids, wire, None, vocab_size, needs_wire)


def _fits(t, ids: torch.Tensor) -> bool:
    """Whether `t` is a wire tensor [b, seq_len, *] for `ids` [b, seq_len+1]."""
    return (type(t) is torch.Tensor and t.dtype in _WIRE_DTYPE_SET and t.dim() == 3
            and t.shape[0] == ids.shape[0] and t.shape[1] == ids.shape[1] - 1)


def _ids_in_range(ids: torch.Tensor, vocab_size: int) -> bool:
    lo, hi = torch.aminmax(ids)
    return int(lo) >= 0 and int(hi) < vocab_size


def _finite(t: torch.Tensor) -> bool:
    """The least and largest value of `t` are finite (NaN propagates to both; an inf shows in one)."""
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


class NormTracker:
    """Recent per-sample RMS of one kind of value (a stage's outputs, or its input gradients) and the
    bound it implies: `multiple` × the **highest median** the window of accepted values has had since
    `warmup` values were accepted (None before) — `early_multiple` × it until `window` values were
    accepted (the window's first fill).

    Why a looser bound early: at the start of training a stage's values grow fast. In the replicated
    swarm test the body's input gradients had an RMS of about 0.0005 in a trainer's first replies and
    0.066 some 20 replies later; the median of a window filled at step 0 lags behind, and 100 × it
    refused honest values (and banned both body workers). A fixed floor under the median does not help:
    it is an absolute scale where the check must be relative, and one of 0.01 let a ×1e6 gradient through
    in the faulty-nodes swarm test. The early bound keeps the ratio, only wider: 1e4 at the default still
    refuses ×1e6 within a few requests whatever the stage's scale, and passes honest growth of over 100×.

    Why the high-water mark, not the current median: a stage's values shrink as the model learns, and
    a bound that shrinks with them refuses honest values of the size the stage produced earlier. A
    small corpus's second epoch did exactly that: the model had memorised most samples, the body's
    input gradients fell to an RMS of 0.0017, and the first sample it had not memorised (0.194, the
    size of first-epoch gradients) was refused as 113x the median — and the only body worker banned.
    Raising the mark takes more than half of the window: a faulty replica among honest ones cannot,
    and one banned within a few requests never gets near it."""

    def __init__(self, multiple: float, window: int = 64, warmup: int = 8, early_multiple: Optional[float] = None):
        self.multiple, self.warmup = float(multiple), int(warmup)
        self.early_multiple = max(self.multiple, float(early_multiple or multiple))
        self.recent: deque[float] = deque(maxlen=max(1, int(window)))
        self._sorted: list[float] = []
        self.peak: Optional[float] = None
        """The highest median of the window so far (None before `warmup` values)."""
        self.seen = 0
        """Values accepted so far (the bound is `early_multiple` × the peak until the window is full once)."""

    def median(self) -> Optional[float]:
        """The lower median of the window: a value accepted, never an average with an outlier (the mark keeps
        whatever it takes)."""
        return self._sorted[(len(self._sorted) - 1) // 2] if self._sorted else None

    def current_multiple(self) -> float:
        """`early_multiple` until the window has been full once, then `multiple`."""
        return self.early_multiple if self.seen < self.recent.maxlen else self.multiple

    def bound(self) -> Optional[float]:
        return None if self.peak is None else self.current_multiple() * max(self.peak, RMS_FLOOR)

    def check(self, name: str, t: torch.Tensor) -> list[float]:
        """Raise :class:`Invalid` if `t` holds a non-finite value or a sample above the bound; else the
        per-sample RMS values (pass them to :meth:`observe` once the whole reply is accepted)."""
        values = rms_per_sample(t)
        worst = values[0] if len(values) == 1 else max(values, default=0.0)
        if not math.isfinite(worst) or (len(values) > 1 and any(v != v for v in values)):  # NaN/inf, overflow
            if not bool(torch.isfinite(t).all()):
                raise _non_finite(name, t)
            raise Invalid("magnitude", f"{name} has values too large for an RMS in fp32")
        if self.peak is not None:  # the bound, inline (a method call per check counts: see rms_per_sample)
            multiple = self.early_multiple if self.seen < self.recent.maxlen else self.multiple
            if worst > multiple * max(self.peak, RMS_FLOOR):
                raise Invalid("magnitude", f"{name} has RMS {worst:.3g}, above {multiple:g} x the stage's "
                                           f"highest recent median ({max(self.peak, RMS_FLOOR):.3g})")
        return values

    def observe(self, values: Sequence[float]) -> None:
        recent, ordered = self.recent, self._sorted
        for v in values:
            if len(recent) == recent.maxlen:
                del ordered[bisect_left(ordered, recent[0])]
            recent.append(v)
            insort(ordered, v)
        self.seen += len(values)
        if len(recent) >= self.warmup:
            m = self.median()
            self.peak = m if self.peak is None else max(self.peak, m)


def loss_bound(vocab_size: int, multiple: float) -> float:
    """Largest per-sample loss accepted: `multiple` × ln(vocab_size) (a uniform guess scores ln V)."""
    return float(multiple) * math.log(max(2, vocab_size))


def check_losses(losses, n: int, vocab_size: int, multiple: float) -> None:
    """Raise :class:`Invalid` unless `losses` holds `n` finite per-sample losses in [0, loss_bound]."""
    if not isinstance(losses, torch.Tensor) or losses.dtype not in _LOSS_DTYPE_SET:
        check_tensor("loss", losses, None, LOSS_DTYPES, finite=False)  # raises, naming the problem
    values = (losses if losses.dim() == 1 else losses.reshape(-1)).tolist()  # a few numbers: checked in Python
    if len(values) != n:
        raise Invalid("shape", f"loss has {len(values)} value(s) for {n} sample(s)")
    top = loss_bound(vocab_size, multiple)
    for v in values:  # one comparison per value on the fast path: NaN fails both, inf the upper one
        if not -1e-4 <= v <= top:
            break
    else:
        return
    bad = sum(not math.isfinite(v) for v in values)
    if bad:
        raise Invalid("non_finite", f"loss holds {bad} non-finite value(s) (NaN or inf) of {n}")
    low, high = min(values), max(values)
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

    def record(self, peer: str, stage: str, reason: str, others_serving: bool = True) -> float:
        """Count one fault of `peer` (a worker of `stage`); returns the ban in seconds.

        0 for a ``magnitude`` fault of the stage's last serving worker (`others_serving` False): a finite
        value above a bound learned from the run is a suspicion, not proof — nothing to compare it with
        when no other replica serves — and banning the only worker loses every later sample of the
        run. The value is still refused (that one sample is lost); non-finite, malformed values and
        impossible losses are proof and ban always."""
        entry = self.counts.setdefault(peer, {"stage": stage})
        entry[reason] = entry.get(reason, 0) + 1
        if reason == "magnitude" and not others_serving:
            return 0.0
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
    only from replies accepted whole.

    A value above its magnitude bound is the worker's fault only if what it was sent was within bounds:
    a stage's output accepted before its bound applied (the first replies a trainer gets, from a replica
    that is already absurd) makes the next stage's honest output absurd too. Such a rejection is raised
    with ``attributable`` False — the sample is dropped, nobody banned — the culprit upstream is caught by
    its own later replies."""

    def __init__(self, run: Run):
        v = run.validation
        self.run, self.v = run, v
        self.width = run.model.ssn.rank or run.model.d_model
        self.dtype = WIRE_DTYPES[run.workers.wire_dtype]
        self.trackers: dict[tuple[str, str], NormTracker] = {}

    def tracker(self, stage: str, kind: str) -> NormTracker:
        key = (stage, kind)
        if key not in self.trackers:
            self.trackers[key] = NormTracker(self.v.norm_multiple, self.v.norm_window, self.v.warmup,
                                                 self.v.early_multiple)
        return self.trackers[key]

    def check(self, stage: str, method: str, sent: dict, out: dict, meta: dict) -> None:
        """Raise :class:`Invalid` naming the first problem of the reply `out`/`meta` to request `sent`."""
        ids = sent["ids"]
        n, length = ids.shape[0], ids.shape[1] - 1  # torch.Size holds ints
        accepted: list[tuple[NormTracker, list[float]]] = []
        if method == "forward":
            wire = out.get("wire")
            if not self._promised(wire, (n, length, self.width)):
                check_tensor("output wire", wire, (n, length, self.width), (self.dtype,), finite=False)
            tracker = self.trackers.get((stage, "output")) or self.tracker(stage, "output")
            accepted.append((tracker, self._magnitude(tracker, "output wire", wire, stage, sent)))
        elif method == "forward_backward":
            check_losses(out.get("loss"), n, self.run.model.vocab_size, self.v.loss_multiple)
        if method != "forward" and sent.get("wire") is not None:
            grad, shape = out.get("grad"), sent["wire"].shape
            if not self._promised(grad, shape):
                check_tensor("input gradient", grad, tuple(shape), (self.dtype,), finite=False)
            tracker = self.trackers.get((stage, "grad")) or self.tracker(stage, "grad")
            accepted.append((tracker, self._magnitude(tracker, "input gradient", grad, stage, sent)))
        step = meta.get("step", 0)
        if type(step) is not int or not 0 <= step <= self.run.training.max_steps:
            raise Invalid("shape", f"reply names step {step!r}, outside [0, training.max_steps]")
        for tracker, values in accepted:
            tracker.observe(values)

    def _promised(self, t, shape) -> bool:
        """The fast path's structural check (a tensor of the wire dtype and `shape`); on False,
        :func:`check_tensor` names the problem."""
        return isinstance(t, torch.Tensor) and t.dtype == self.dtype and t.shape == shape

    def _magnitude(self, tracker: NormTracker, name: str, t: torch.Tensor, stage: str, sent: dict) -> list[float]:
        """:meth:`NormTracker.check`; a magnitude rejection is re-examined (only then: it costs an operation
        per input) against the bounds of the stages that produced the request's inputs."""
        try:
            return tracker.check(name, t)
        except Invalid as e:
            if e.reason == "magnitude" and not self._inputs_vetted(stage, sent):
                raise Invalid("magnitude", f"{e} (after an input accepted unbounded: not this worker's fault)",
                              attributable=False) from None
            raise

    def _inputs_vetted(self, stage: str, sent: dict) -> bool:
        """Whether the request's wire (the previous stage's output) and grad (the next stage's input gradient)
        are within their producers' bounds now (False when a producer has no bound yet)."""
        names = self.run.stage_names()
        i = names.index(stage)
        for key, producer in (("wire", (names[i - 1], "output") if i > 0 else None),
                              ("grad", (names[i + 1], "grad") if i + 1 < len(names) else None)):
            t = sent.get(key)
            if t is None or producer is None:
                continue
            bound = self.tracker(*producer).bound()
            if bound is None or max(rms_per_sample(t), default=0.0) > bound:
                return False
        return True
