"""A communication model that turns training steps into wall-clock time and compute utilization.

Pure arithmetic, no networking; the simulator uses it to put its loss curves on a time axis.
Every peer has a full-duplex link of ``bandwidth_mbps`` Mbit/s each way and a one-way latency of
``latency_ms``; a collective costs what the busiest peer must send (it receives as much at the same
time):

- ``global`` (average over all M replicas), costed one of two ways (``global_mixing``):
  ``butterfly`` (hivemind's butterfly all-reduce, bandwidth-optimal: reduce-scatter then all-gather,
  each moving (M−1)/M of the payload): ``2·(M−1)/M·bytes/bandwidth + 2·latency``; or ``all-to-all``
  (gossip accounting, seed 002: a mixing costs one payload exchange per partner in the mixing graph,
  and global averaging is the complete graph, every replica exchanging with the M−1 others over
  concurrent connections): ``(M−1)·bytes/bandwidth + latency``;
- ``local`` (pairwise averaging with one partner): the whole payload one way while the partner's
  comes the other way: ``bytes/bandwidth + latency``;
- ``none``: free.

Under ``butterfly`` a pairwise exchange costs M/(2(M−1)) of a global mixing (4/7 at M = 8), under
``all-to-all`` 1/(M−1): the second is what makes seed 002's local Mix2 "light" and GlobalM1LocalM2's
blocking "small" next to DiLoCo's global Mix2.

Blocking communication stalls compute. Non-blocking communication (FGDiLoCo's Mix1, AsyncSPARTA)
overlaps with the compute available until the result is needed; only the part that does not fit
stalls. Utilization = compute time / wall time.
"""

from __future__ import annotations

from dataclasses import dataclass

BITS_PER_BYTE = 8
GLOBAL_MIXING = ("butterfly", "all-to-all")


@dataclass(frozen=True)
class RoundTime:
    """Wall-clock accounting of one round: compute, and the stalls that blocked it."""

    compute_s: float
    overlap_stall_s: float
    blocking_s: float

    @property
    def wall_s(self) -> float:
        return self.compute_s + self.overlap_stall_s + self.blocking_s

    @property
    def utilization(self) -> float:
        return self.compute_s / self.wall_s if self.wall_s > 0 else 1.0


@dataclass(frozen=True)
class CommModel:
    """Link bandwidth in Mbit/s (each way) and one-way latency in ms, the same for every peer, and how a
    global mixing is costed (``butterfly`` or ``all-to-all``, see the module docstring)."""

    bandwidth_mbps: float
    latency_ms: float = 0.0
    global_mixing: str = "butterfly"

    def __post_init__(self) -> None:
        if self.bandwidth_mbps <= 0:
            raise ValueError(f"bandwidth_mbps must be positive; got {self.bandwidth_mbps}")
        if self.latency_ms < 0:
            raise ValueError(f"latency_ms must be non-negative; got {self.latency_ms}")
        if self.global_mixing not in GLOBAL_MIXING:
            raise ValueError(f"global_mixing must be one of {', '.join(GLOBAL_MIXING)}; got {self.global_mixing!r}")

    def transfer_s(self, payload_bytes: float) -> float:
        """Seconds to push `payload_bytes` through one link, latency excluded."""
        return payload_bytes * BITS_PER_BYTE / (self.bandwidth_mbps * 1e6)

    def collective_s(self, kind: str, payload_bytes: float, replicas: int) -> float:
        """Seconds one mixing of `payload_bytes` per replica takes: kind global, local or none."""
        if kind == "none" or replicas < 2:
            return 0.0
        latency = self.latency_ms / 1e3
        if kind == "global" and self.global_mixing == "all-to-all":
            return (replicas - 1) * self.transfer_s(payload_bytes) + latency
        if kind == "global":
            return 2 * (replicas - 1) / replicas * self.transfer_s(payload_bytes) + 2 * latency
        if kind == "local":
            return self.transfer_s(payload_bytes) + latency
        raise ValueError(f"unknown mixing {kind!r}; one of none, global, local")

    def round_time(self, compute_s: float, overlapped_s: float = 0.0, blocking_s: float = 0.0) -> RoundTime:
        """A round of `compute_s` of compute, with `overlapped_s` of non-blocking communication started at
        its beginning and needed at its end, followed by `blocking_s` of blocking communication.

        The two share one link, so the blocking part starts only once the overlapped part is done.
        """
        return RoundTime(compute_s=compute_s, overlap_stall_s=max(0.0, overlapped_s - compute_s),
                         blocking_s=blocking_s)
