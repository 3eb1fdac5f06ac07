"""Rule-based worker self-termination (report §3.3.1.6): rules over structured events, exit codes.

A worker feeds :class:`SelfTermination` the events it produces anyway (never its log text) and
exits when a rule fires (:class:`agoractl.training.self_termination.Monitor` does the feeding), with the rule's exit code and one final log line naming it. Rules, from
``workers.self_termination`` in the manifest:

==================== ==== =====================================================================
rule                 code fires when
==================== ==== =====================================================================
nan_gradients        81   a gradient holds NaN or inf (immediate)
allreduce_failures   82   ``allreduce_failures`` of the last ``window_rounds`` SPARTA rounds
                          failed (report: 2 of 3; a round that formed no group, timed out, or got
                          nothing back; partial rounds are not failures)
ram                  83   host RAM use above ``max_ram_fraction``
dht_unreachable      84   the DHT (peer-to-peer connectivity, the run's progress) unreachable for
                          ``dht_unreachable_s`` seconds
device_error         85   the accelerator failed (e.g. a CUDA error; immediate)
refused_outputs      87   trainers rejected this worker's outputs (non-finite, malformed or
                          absurd; :mod:`agoractl.algorithms.validation`): ``refused_outputs``
                          notices within ``refused_window_s`` seconds, from at least
                          ``refused_min_trainers`` distinct trainers (one trainer alone cannot
                          make an honest worker leave)
==================== ==== =====================================================================

Exit code 86 (:data:`EXIT_PREEMPTED`) is not a rule: it is how a worker preempted by fault
injection (``agoractl ops preempt``, report §3.5.3.1) exits. Codes 1 and 2 keep their meaning
(runtime failure, usage error).

Events (dicts with an ``event`` key):
``{"event": "gradients", "finite": bool, "step": int}``,
``{"event": "round", "status": "complete"|"partial"|"failed"|"empty"|"skipped", "round": int}``,
``{"event": "ram", "fraction": float}``, ``{"event": "dht", "ok": bool, "time": float}``,
``{"event": "device_error", "error": str}``,
``{"event": "refused", "trainer": str, "reason": str, "time": float}``. Unknown events are ignored.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from agoractl.manifest.workers import SelfTermination as SelfTerminationConfig

EXIT_CODES: dict[str, int] = {
    "nan_gradients": 81,
    "allreduce_failures": 82,
    "ram": 83,
    "dht_unreachable": 84,
    "device_error": 85,
    "refused_outputs": 87,
}
"""Exit code of each self-termination rule; distinct, and distinct from 0, 1, 2 and 86."""

EXIT_PREEMPTED = 86
"""Exit code of a worker preempted by fault injection (not a self-termination rule)."""

ROUND_FAILED = "failed"
"""The round status that counts toward ``allreduce_failures``; skipped/empty rounds do not count."""


@dataclass(frozen=True)
class Termination:
    """A fired rule: the worker must exit with `exit_code` after one log line carrying `message`."""

    rule: str
    exit_code: int
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "exit_code": self.exit_code, "message": self.message}


def _fire(rule: str, message: str) -> Termination:
    return Termination(rule=rule, exit_code=EXIT_CODES[rule], message=message)


class SelfTermination:
    """Evaluates the rules on a stream of events; :meth:`observe` returns the first rule that fires."""

    def __init__(self, config: SelfTerminationConfig, clock=time.monotonic):
        self.config = config
        self.clock = clock
        self.rounds: deque[bool] = deque(maxlen=config.window_rounds)  # True = failed
        self.dht_down_since: Optional[float] = None
        self.notices: deque[tuple[float, str]] = deque()  # (time, trainer) of refused outputs
        self.fired: Optional[Termination] = None

    def observe(self, event: Mapping[str, Any]) -> Optional[Termination]:
        """Update the rules with one event; the Termination once a rule fires (and ever after)."""
        if self.fired is None:
            kind = event.get("event")
            handler = getattr(self, f"_on_{kind}", None) if isinstance(kind, str) else None
            if handler is not None:
                self.fired = handler(event)
        return self.fired

    def _on_gradients(self, e: Mapping[str, Any]) -> Optional[Termination]:
        if not e.get("finite", True):
            return _fire("nan_gradients", f"non-finite gradients at step {e.get('step')}")
        return None

    def _on_round(self, e: Mapping[str, Any]) -> Optional[Termination]:
        status = e.get("status")
        if status not in ("complete", "partial", ROUND_FAILED):
            return None  # skipped (nobody to average with) and empty rounds say nothing about this peer
        self.rounds.append(status == ROUND_FAILED)
        failures, need = sum(self.rounds), self.config.allreduce_failures
        if failures >= need:
            return _fire("allreduce_failures",
                         f"{failures} of the last {len(self.rounds)} averaging rounds failed (limit {need} of "
                         f"{self.config.window_rounds}; last round {e.get('round')})")
        return None

    def _on_ram(self, e: Mapping[str, Any]) -> Optional[Termination]:
        fraction = float(e["fraction"])
        if fraction > self.config.max_ram_fraction:
            return _fire("ram", f"host RAM use {fraction:.1%} exceeds {self.config.max_ram_fraction:.1%}")
        return None

    def _on_dht(self, e: Mapping[str, Any]) -> Optional[Termination]:
        now = float(e.get("time", self.clock()))
        if e.get("ok", True):
            self.dht_down_since = None
            return None
        if self.dht_down_since is None:
            self.dht_down_since = now
        down = now - self.dht_down_since
        if down >= self.config.dht_unreachable_s:
            return _fire("dht_unreachable", f"the DHT has been unreachable for {down:.0f} s "
                                            f"(limit {self.config.dht_unreachable_s:g} s)")
        return None

    def _on_device_error(self, e: Mapping[str, Any]) -> Optional[Termination]:
        return _fire("device_error", f"accelerator failure: {e.get('error', 'unknown')}")

    def _on_refused(self, e: Mapping[str, Any]) -> Optional[Termination]:
        now = float(e.get("time", self.clock()))
        self.notices.append((now, str(e.get("trainer", ""))))
        while self.notices and now - self.notices[0][0] > self.config.refused_window_s:
            self.notices.popleft()
        trainers = {t for _, t in self.notices}
        if len(self.notices) >= self.config.refused_outputs and len(trainers) >= self.config.refused_min_trainers:
            return _fire("refused_outputs", f"{len(trainers)} trainers refused {len(self.notices)} of this worker's "
                                            f"outputs within {self.config.refused_window_s:g} s (last: "
                                            f"{e.get('reason', 'unknown')})")
        return None
