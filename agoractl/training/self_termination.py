"""A worker's self-termination monitor: feeds the rules of :mod:`agoractl.algorithms.termination`
with the worker's structured events and samples host RAM on a thread (report §3.3.1.6)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Optional

import psutil

from agoractl.algorithms.termination import SelfTermination, Termination
from agoractl.manifest.workers import SelfTermination as SelfTerminationConfig


def host_ram_fraction() -> float:
    """Fraction of host RAM in use (total minus available, over total)."""
    vm = psutil.virtual_memory()
    return (vm.total - vm.available) / vm.total


class Monitor:
    """A worker's self-termination monitor: a listener of its structured events that also samples
    host RAM every `ram_period_s`, and calls `on_fire` once, with the first rule that fires."""

    def __init__(self, config: SelfTerminationConfig, on_fire: Callable[[Termination], None],
                 ram_period_s: float = 5.0, ram_fraction: Callable[[], float] = host_ram_fraction):
        self.rules = SelfTermination(config)
        self.on_fire, self.ram_period_s, self.ram_fraction = on_fire, ram_period_s, ram_fraction
        self.fired: Optional[Termination] = None
        self._lock = threading.Lock()

    def __call__(self, event: Mapping[str, Any]) -> None:
        with self._lock:
            if self.fired is not None:
                return
            self.fired = self.rules.observe(event)
            fired = self.fired
        if fired is not None:
            self.on_fire(fired)

    def start(self, stop: threading.Event) -> threading.Thread:
        """Sample host RAM until `stop` is set (a daemon thread)."""

        def loop():
            while not stop.wait(self.ram_period_s):
                self({"event": "ram", "fraction": self.ram_fraction()})

        t = threading.Thread(target=loop, name="self-termination", daemon=True)
        t.start()
        return t
