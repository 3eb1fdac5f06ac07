"""Contribution scores as pure functions (agoractl/services/dashboard/scores.py) against a hand computation:
PFLOPs from samples x FLOPs per sample, presence credit from a presence history with a departure and a return,
and ranks (score descending, ties by name). In-memory."""

from __future__ import annotations

import pytest

from agoractl.services.dashboard.scores import Weights, hours_present, leaderboard

W = Weights(points_per_pflop=3.0, points_per_hour=0.5)


def test_hours_present_from_history():
    events = [("left", 5400.0), ("joined", 0.0), ("joined", 9000.0)]  # any order
    assert hours_present(events, last_seen=10800.0) == pytest.approx(1.5 + 0.5)
    assert hours_present([("joined", 100.0), ("left", 1900.0)], last_seen=50_000.0) == pytest.approx(0.5)
    assert hours_present([], last_seen=10.0) == 0.0


def test_scores_and_ranks_equal_a_hand_computation():
    nodes = [  # 4e3 samples x 5e11 FLOPs = 2 PFLOPs; 1e3 x 1e12 = 1 PFLOP; 2e3 x 1e12 = 2 PFLOPs
        {"node": "w1", "account": "ann", "kind": "worker", "stage": "head", "flops": 4e3 * 5e11,
         "events": [("joined", 0.0), ("left", 7200.0)], "last_seen": 7200.0},
        {"node": "w2", "account": "ben", "kind": "worker", "stage": "tail", "flops": 1e3 * 1e12,
         "events": [("joined", 0.0)], "last_seen": 14400.0},
        {"node": "w3", "account": "ann", "kind": "worker", "stage": "tail", "flops": 2e3 * 1e12,
         "events": [("joined", 3600.0)], "last_seen": 10800.0},
        {"node": "t0", "account": "ben", "kind": "trainer", "stage": None, "flops": 0.0,
         "events": [("joined", 0.0)], "last_seen": 36000.0},
    ]
    # w1: 3 x 2 + 0.5 x 2 = 7; w2: 3 x 1 + 0.5 x 4 = 5; w3: 3 x 2 + 0.5 x 2 = 7; t0: 0.5 x 10 = 5.
    board = leaderboard(nodes, W)
    assert [(n["rank"], n["node"], n["score"]) for n in board["nodes"]] == [
        (1, "w1", 7.0), (2, "w3", 7.0), (3, "t0", 5.0), (4, "w2", 5.0)]  # ties by name
    assert [(a["rank"], a["account"], a["nodes"], a["pflops"], a["hours"], a["score"]) for a in board["accounts"]] == [
        (1, "ann", 2, 4.0, 4.0, 14.0), (2, "ben", 2, 1.0, 14.0, 10.0)]
