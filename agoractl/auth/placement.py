"""Stage placement (report §3.6.1.4): which stage an admitted worker serves.

The least-provisioned allowed stage that still has room; among equally provisioned stages a more capable node
(at least twice the minimum accelerator memory) takes the heaviest (most layers), others the lightest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class StageSlot:
    name: str
    role: str
    """head, body or tail."""
    layers: int
    workers: int
    """Workers admitted there now."""
    cap: Optional[int] = None
    """Most workers allowed there; None = no cap."""


def place(slots: list[StageSlot], allowed: list[str], capable: bool) -> Optional[str]:
    """The stage for the next worker, or None when every allowed stage is full."""
    open_ = [s for s in slots if (not allowed or s.name in allowed) and (s.cap is None or s.workers < s.cap)]
    if not open_:
        return None
    fewest = min(s.workers for s in open_)
    ties = [s for s in open_ if s.workers == fewest]
    if capable:
        return max(ties, key=lambda s: (s.layers, -slots.index(s))).name
    return min(ties, key=lambda s: (s.layers, slots.index(s))).name
