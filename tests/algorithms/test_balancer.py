"""The trainer's virtual-runtime balancer (agoractl.algorithms.balancer). Pure: in-memory, no network,
explicit clock."""

from __future__ import annotations

from collections import Counter

from agoractl.algorithms.balancer import Balancer


def drive(b: Balancer, n: int, speeds: dict[str, float], now: float = 0.0) -> Counter:
    """Choose n times; each chosen worker completes one sample at its speed (samples/s)."""
    got = Counter()
    for _ in range(n):
        peer = b.choose(now)
        got[peer] += 1
        b.record_success(peer, 1.0, 1.0 / speeds[peer])
    return got


def test_work_spreads_in_proportion_to_measured_speed():
    b = Balancer(ban_s=10)
    b.update({"fast": None, "slow": None}, now=0)
    got = drive(b, 400, {"fast": 30.0, "slow": 10.0})
    assert 2.5 < got["fast"] / got["slow"] < 3.5


def test_equal_workers_alternate():
    b = Balancer(ban_s=10)
    b.update({"a": 5.0, "b": 5.0}, now=0)
    got = drive(b, 10, {"a": 5.0, "b": 5.0})
    assert got == {"a": 5, "b": 5}


def test_newcomer_enters_level_with_the_most_loaded():
    b = Balancer(ban_s=10)
    b.update({"a": 1.0, "b": 1.0}, now=0)
    for _ in range(20):
        b.choose(0)
    top = max(w.vruntime for w in b.workers.values())
    b.update({"a": 1.0, "b": 1.0, "new": 1.0}, now=0)
    assert b.workers["new"].vruntime == top
    # level, not at zero: it shares the next choices instead of taking all of them
    got = Counter(b.choose(0) for _ in range(6))
    assert got["new"] == 2 and got["a"] == 2 and got["b"] == 2


def test_banned_worker_is_skipped_until_the_ban_expires_then_re_enters_level():
    b = Balancer(ban_s=5)
    b.update({"a": 1.0, "b": 1.0}, now=0)
    b.ban("a", now=0)
    assert b.bans == 1 and b.is_banned("a", 1)
    assert {b.choose(1) for _ in range(5)} == {"b"}
    assert b.available(1) == ["b"]
    assert b.choose(6) in {"a", "b"}  # ban over
    assert b.workers["a"].vruntime >= b.workers["b"].vruntime - 1.0  # not flooded after its pause
    got = Counter(b.choose(6) for _ in range(10))
    assert abs(got["a"] - got["b"]) <= 2


def test_exclude_and_nothing_available():
    b = Balancer(ban_s=5)
    b.update({"a": 1.0, "b": 1.0}, now=0)
    assert b.choose(0, exclude={"a"}) == "b"
    assert b.choose(0, exclude={"a", "b"}) is None
    b.ban("a", 0)
    b.ban("b", 0)
    assert b.choose(1) is None


def test_pardon_lifts_the_ban_that_ends_first_and_only_for_banned_listed_workers():
    b = Balancer(ban_s=5)
    b.update({"a": 1.0, "b": 1.0, "c": 1.0}, now=0)
    assert b.pardon(0) is None  # nobody banned
    b.ban("a", 0, 30)
    b.ban("b", 0, 10)
    b.ban("c", 0, 20)
    assert b.choose(1) is None
    assert b.pardon(1, exclude={"b"}) == "c" and not b.is_banned("c", 1) and b.is_banned("b", 1)
    assert b.pardon(1) == "b" and b.available(1) == ["b", "c"]
    assert b.workers["b"].vruntime >= b.workers["c"].vruntime  # level with the most loaded, not flooded
    b.update({"b": 1.0, "c": 1.0}, now=1)
    assert b.pardon(1) is None  # a banned worker discovery no longer lists is never pardoned


def test_discovery_drops_vanished_workers_and_bans_unknown_peers():
    b = Balancer(ban_s=5)
    added, removed = b.update({"a": 1.0, "b": 1.0}, now=0)
    assert sorted(added) == ["a", "b"] and removed == []
    added, removed = b.update({"b": 1.0}, now=1)
    assert added == [] and removed == ["a"]
    assert {b.choose(1) for _ in range(3)} == {"b"}
    b.ban("ghost", 1)  # a peer discovery still lists elsewhere is remembered as banned
    b.update({"b": 1.0, "ghost": 1.0}, now=2)
    assert b.is_banned("ghost", 2)


def test_task_size_is_charged_by_throughput():
    b = Balancer(ban_s=5)
    b.update({"a": 2.0, "b": 2.0}, now=0)
    assert b.choose(0, task_size=4.0) == "a"
    assert b.workers["a"].vruntime == 2.0
    assert b.choose(0, task_size=1.0) == "b"
    assert b.choose(0, task_size=1.0) == "b"  # b at 0.5 < a at 2.0


def drive_timed(b: Balancer, n: int, elapsed) -> list[str]:
    """Choose n times; the k-th call (from 1) of a chosen worker takes elapsed(peer, k) seconds for one sample."""
    calls, got = Counter(), []
    for _ in range(n):
        peer = b.choose(0)
        calls[peer] += 1
        got.append(peer)
        b.record_success(peer, 1.0, elapsed(peer, calls[peer]))
    return got


def test_one_slow_first_call_does_not_starve_a_replica():
    # c's first call is 10x slow (connection set-up on a loaded host), then it is as fast as its peers: its first
    # measurement is blended with its measured peers', so it is not charged 10x on every later choice
    b = Balancer(ban_s=10)
    b.update({"a": None, "b": None, "c": None}, now=0)
    got = drive_timed(b, 60, lambda peer, k: 1.0 if (peer, k) == ("c", 1) else 0.1)
    later = Counter(got[10:])
    assert later["c"] >= 0.8 * 50 / 3, later  # a fair share from the 10th choice on (old rule: 5 of 50)


def test_a_truly_slow_replica_still_gets_less():
    b = Balancer(ban_s=10)
    b.update({"a": None, "b": None, "c": None}, now=0)
    got = drive_timed(b, 400, lambda peer, k: 1.0 if peer == "c" else 0.1)
    later = Counter(got[200:])
    assert later["c"] < later["a"] / 5 and later["c"] < later["b"] / 5, later


def test_a_replica_charged_at_a_too_low_estimate_is_not_left_behind_once_fast():
    # b was 100x slower than a for a long while (a GC storm, a co-tenant), so its estimate fell to 1/100 of a's
    # and its last charge is 100 of a's tasks; once its calls are fast its account is settled at the new
    # estimate, instead of a working off that debt first
    b = Balancer(ban_s=10)
    b.update({"a": None, "b": None}, now=0)
    drive_timed(b, 400, lambda peer, k: 10.0 if peer == "b" else 0.1)
    got = Counter(drive_timed(b, 100, lambda peer, k: 0.1))
    assert got["b"] >= 20, got  # without settling: 1 of 100


def test_a_refunded_call_leaves_the_worker_as_if_never_chosen():
    """A replica that answered without working (waiting in a mix, or finished) owes nothing for the call."""
    b = Balancer(ban_s=5)
    b.update({"a": 10.0, "b": 10.0}, now=0)
    first = b.choose(now=0, task_size=2)
    b.refund(first, task_size=2)
    assert b.workers[first].vruntime == b.workers[({"a", "b"} - {first}).pop()].vruntime == 0
    assert {b.choose(now=0, task_size=2), b.choose(now=0, task_size=2)} == {"a", "b"}  # level again
