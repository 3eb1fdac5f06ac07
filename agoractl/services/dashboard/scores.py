"""Contribution scores (report §3.1 "contributed FLOPs", §3.6.4 "contribution score"), as pure functions:

    score = dashboard.score.points_per_pflop x PFLOPs + dashboard.score.points_per_hour x hours present

PFLOPs: the samples a worker trained x its stage's FLOPs per sample (the Health Monitor's
``health_contributions.flops``) / 1e15; trainers contribute no FLOPs. Hours present: from the node's presence
history, each ``joined`` event to the next ``left`` one; a stay with no ``left`` yet ends at the node's last
sighting. An account's score is its nodes' sum. Ranks: score descending, ties by name, 1, 2, 3, ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

PFLOP = 1e15


@dataclass(frozen=True)
class Weights:
    points_per_pflop: float
    points_per_hour: float


def hours_present(events: Iterable[tuple[str, float]], last_seen: Optional[float]) -> float:
    """Hours between each joined and the next left in EVENTS ((event, at), any order); an open stay ends at
    LAST_SEEN (never before its joining)."""
    total, since = 0.0, None
    for event, at in sorted(events, key=lambda e: e[1]):
        if event == "joined" and since is None:
            since = at
        elif event == "left" and since is not None:
            total += at - since
            since = None
    if since is not None and last_seen is not None:
        total += max(0.0, last_seen - since)
    return total / 3600.0


def node_score(flops: float, hours: float, w: Weights) -> float:
    return w.points_per_pflop * flops / PFLOP + w.points_per_hour * hours


def ranked(rows: list[dict], name: str) -> list[dict]:
    """ROWS sorted by score (descending, ties by their NAME field) with ``rank`` 1, 2, 3, ..."""
    out = sorted(rows, key=lambda r: (-r["score"], str(r[name])))
    return [{"rank": i + 1, **r} for i, r in enumerate(out)]


def leaderboard(nodes: list[dict], w: Weights) -> dict:
    """NODES: {node, account, kind, stage, flops, events [(event, at)], last_seen}. Returns {"nodes": [...],
    "accounts": [...]}, each ranked, scores rounded to 6 decimals for display stability."""
    per_node = []
    for n in nodes:
        hours = hours_present(n["events"], n["last_seen"])
        per_node.append({"node": n["node"], "account": n["account"], "kind": n["kind"], "stage": n["stage"],
                         "pflops": n["flops"] / PFLOP, "hours": hours,
                         "score": round(node_score(n["flops"], hours, w), 6)})
    accounts: dict[str, dict] = {}
    for n in per_node:
        a = accounts.setdefault(n["account"], {"account": n["account"], "nodes": 0, "pflops": 0.0, "hours": 0.0,
                                               "score": 0.0})
        a["nodes"] += 1
        a["pflops"] += n["pflops"]
        a["hours"] += n["hours"]
        a["score"] = round(a["score"] + n["score"], 6)
    return {"nodes": ranked(per_node, "node"), "accounts": ranked(list(accounts.values()), "account")}
