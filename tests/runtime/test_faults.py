"""Preemption signals (agoractl.runtime.faults): target choice in memory, the signal through a real DHT."""

from types import SimpleNamespace as W

import pytest

from agoractl.runtime.faults import PreemptSignal, choose_targets, eligible, read_signals, write_signal
from agoractl.training.sparta_rounds import fault_for

WORKERS = [W(peer="a", role="operator"), W(peer="b", role="contributor"), W(peer="c", role="operator"),
           W(peer="d", role="contributor")]


def test_reduce_hits_reducers_only_and_role_narrows():
    assert eligible(WORKERS, "reduce") == ["a", "c"]
    assert eligible(WORKERS, "send") == ["a", "b", "c", "d"]
    assert eligible(WORKERS, "send", role="contributor") == ["b", "d"]
    with pytest.raises(ValueError):
        eligible(WORKERS, "sideways")


def test_choose_targets_exact_count_and_seeded():
    assert len(choose_targets(["a", "b", "c"], 2)) == 2
    assert choose_targets(["a", "b"], 5) == ["a", "b"]
    assert choose_targets(["a", "b", "c", "d"], 2, seed=1) == choose_targets(["d", "c", "b", "a"], 2, seed=1)


def test_a_signal_acts_once_on_its_targets():
    s1 = PreemptSignal(during="send", targets=["a"], issued=1.0)
    s2 = PreemptSignal(during="reduce", targets=["a", "c"], issued=2.0)
    assert fault_for([s1, s2], "b", set()) is None
    assert fault_for([s1, s2], "a", set()) is s1
    assert fault_for([s1, s2], "a", {s1.id}) is s2
    assert PreemptSignal.from_dict(s2.to_dict()) == s2
    assert PreemptSignal.from_dict({"during": "later", "targets": []}) is None


def test_signal_round_trip_through_a_dht():
    import hivemind

    dht = hivemind.DHT(start=True, startup_timeout=120)
    try:
        sig = PreemptSignal(during="reduce", targets=["peer-x"])
        assert write_signal(dht, "run", "body-1", sig, ttl_s=60)
        assert read_signals(dht, "run", "body-1") == [sig]
        assert read_signals(dht, "run", "head") == []
    finally:
        dht.shutdown()
