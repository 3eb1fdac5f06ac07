"""Unit tests of the self-termination rules (agoractl.algorithms.termination): in-memory, no network."""

import pytest

from agoractl.manifest.workers import SelfTermination as Config
from agoractl.algorithms.termination import EXIT_CODES, EXIT_PREEMPTED, SelfTermination


def rounds(rules, statuses):
    out = None
    for i, s in enumerate(statuses):
        out = rules.observe({"event": "round", "status": s, "round": i})
    return out


def test_exit_codes_are_distinct_and_clear_of_the_cli_codes():
    codes = list(EXIT_CODES.values()) + [EXIT_PREEMPTED]
    assert len(set(codes)) == len(codes)
    assert not {0, 1, 2, 130} & set(codes)


def test_non_finite_gradients_fire_at_once():
    rules = SelfTermination(Config())
    assert rules.observe({"event": "gradients", "finite": True, "step": 3}) is None
    t = rules.observe({"event": "gradients", "finite": False, "step": 4})
    assert t.rule == "nan_gradients" and t.exit_code == EXIT_CODES["nan_gradients"] and "step 4" in t.message


@pytest.mark.parametrize("statuses, fires", [
    (["failed", "complete", "failed"], True),     # two of the last three, not consecutive (report §6.4)
    (["failed", "failed"], True),
    (["failed", "complete", "complete", "failed"], False),  # the first failure left the window
    (["partial", "partial", "partial"], False),  # partial rounds still averaged something
    (["failed", "skipped", "empty", "complete"], False),  # skipped/empty rounds do not count
])
def test_two_failures_in_a_window_of_three(statuses, fires):
    t = rounds(SelfTermination(Config(allreduce_failures=2, window_rounds=3)), statuses)
    assert (t is not None and t.rule == "allreduce_failures") == fires


def test_a_fired_rule_sticks():
    rules = SelfTermination(Config())
    first = rules.observe({"event": "gradients", "finite": False, "step": 1})
    assert rules.observe({"event": "round", "status": "complete"}) is first


def test_ram_threshold():
    rules = SelfTermination(Config(max_ram_fraction=0.8))
    assert rules.observe({"event": "ram", "fraction": 0.79}) is None
    assert rules.observe({"event": "ram", "fraction": 0.81}).rule == "ram"


def test_dht_unreachable_for_longer_than_the_limit():
    rules = SelfTermination(Config(dht_unreachable_s=30))
    assert rules.observe({"event": "dht", "ok": False, "time": 100.0}) is None
    assert rules.observe({"event": "dht", "ok": True, "time": 120.0}) is None  # recovered: the clock restarts
    assert rules.observe({"event": "dht", "ok": False, "time": 125.0}) is None
    assert rules.observe({"event": "dht", "ok": False, "time": 150.0}) is None
    t = rules.observe({"event": "dht", "ok": False, "time": 155.0})
    assert t.rule == "dht_unreachable" and t.exit_code == EXIT_CODES["dht_unreachable"]


def test_device_errors_and_unknown_events():
    rules = SelfTermination(Config())
    assert rules.observe({"event": "something_else"}) is None
    assert rules.observe({"event": "device_error", "error": "CUDA error: an illegal memory access"}).rule == "device_error"
