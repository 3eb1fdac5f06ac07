"""``agoractl ops preempt``: real CLI subprocesses against a real DHT (the test process hosts the seed and
announces worker records the way workers do)."""

import json

import pytest

from tests.conftest import MANIFESTS

MANIFEST = str(MANIFESTS / "local-cpu.yaml")


@pytest.fixture(scope="module")
def dht_with_workers():
    import hivemind

    from agoractl.runtime.records import RunRecords, WorkerRecord

    dht = hivemind.DHT(start=True, startup_timeout=120)
    try:
        recs = RunRecords(dht, "local-cpu")
        for peer, role in (("op-a", "operator"), ("op-b", "operator"), ("co-c", "contributor")):
            assert recs.announce_worker(WorkerRecord(peer=peer, stage="body-1", role=role), ttl_s=600)
        yield dht, [str(a) for a in dht.get_visible_maddrs()]
    finally:
        dht.shutdown()


def peer_args(maddrs):
    return [a for m in maddrs for a in ("--initial-peers", m)]


def test_preempt_writes_a_signal_for_the_chosen_workers(cli, dht_with_workers):
    from agoractl.runtime.faults import read_signals

    dht, maddrs = dht_with_workers
    r = cli("ops", "preempt", MANIFEST, "--stage", "body-1", "--count", "2", "--during", "reduce", "--json", check=0,
            *peer_args(maddrs))
    out = json.loads(r.stdout)
    assert out["targets"] == ["op-a", "op-b"] and out["during"] == "reduce" and out["stage"] == "body-1"
    r = cli("ops", "preempt", MANIFEST, "--stage", "body-1", "--count", "1", "--during", "send",
            "--role", "contributor", "--json", *peer_args(maddrs), check=0)
    assert json.loads(r.stdout)["targets"] == ["co-c"]
    signals = {s.id: s for s in read_signals(dht, "local-cpu", "body-1")}
    assert signals[out["signal"]].targets == ["op-a", "op-b"] and len(signals) == 2


def test_preempt_with_nobody_eligible_is_a_runtime_error(cli, dht_with_workers):
    _, maddrs = dht_with_workers
    r = cli("ops", "preempt", MANIFEST, "--stage", "tail", "--during", "send", *peer_args(maddrs), check=1)
    assert "no live worker of stage tail" in r.stderr and len(r.stderr.strip().splitlines()) == 2


@pytest.mark.parametrize("args, message", [
    (["--stage", "nope"], "--stage nope: no such stage"),
    (["--stage", "tail", "--during", "reduce", "--role", "contributor"], "contributors never reduce"),
    (["--stage", "tail", "--during", "later"], "error: Invalid value for '--during': 'later' is not one of 'send', 'reduce'."),
    (["--stage", "tail", "--set", "local.run_dir=/nonexistent/run"], "no DHT to join"),
])
def test_usage_errors(cli, args, message):
    r = cli("ops", "preempt", MANIFEST, *args, check=2)
    assert message in r.stderr
