"""``agoractl ops preempt``: real CLI subprocesses against a real DHT (the test process hosts the seed and
announces worker records the way workers do). The module's invocations run once, one after another in one
interpreter (``cli_batch``: hivemind and torch are imported once); each test checks its own."""

import json

import pytest

from tests.conftest import MANIFESTS, cli_batch

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


USAGE = [
    (["--stage", "nope"], "--stage nope: no such stage"),
    (["--stage", "tail", "--during", "reduce", "--role", "contributor"], "contributors never reduce"),
    (["--stage", "tail", "--during", "later"],
     "error: Invalid value for '--during': 'later' is not one of 'send', 'reduce'."),
    (["--stage", "tail", "--set", "local.run_dir=/nonexistent/run"], "no DHT to join"),
]


@pytest.fixture(scope="module")
def preempts(dht_with_workers, tmp_path_factory):
    """The module's `ops preempt` invocations, one after another in one interpreter (``cli_batch``)."""
    _, maddrs = dht_with_workers
    runs = {
        "operators": ["ops", "preempt", MANIFEST, "--stage", "body-1", "--count", "2", "--during", "reduce", "--json",
                      *peer_args(maddrs)],
        "contributor": ["ops", "preempt", MANIFEST, "--stage", "body-1", "--count", "1", "--during", "send",
                        "--role", "contributor", "--json", *peer_args(maddrs)],
        "nobody": ["ops", "preempt", MANIFEST, "--stage", "tail", "--during", "send", *peer_args(maddrs),
                   "--set", "workers.announce_period_s=1"],  # re-read twice, a second apart, before it says so
        **{f"usage{i}": ["ops", "preempt", MANIFEST, *args] for i, (args, _) in enumerate(USAGE)},
        "churn-stage": ["ops", "churn", MANIFEST, "--every", "5", "--for", "5", "--stage", "head", "--stage", "nope"],
    }
    return dict(zip(runs, cli_batch(runs.values(), cwd=tmp_path_factory.mktemp("ops-cli"))))


def exits(proc, code: int):
    assert proc.returncode == code, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_preempt_writes_a_signal_for_the_chosen_workers(preempts, dht_with_workers):
    from agoractl.runtime.faults import read_signals

    dht, maddrs = dht_with_workers
    r = exits(preempts["operators"], 0)
    out = json.loads(r.stdout)
    assert out["targets"] == ["op-a", "op-b"] and out["during"] == "reduce" and out["stage"] == "body-1"
    r = exits(preempts["contributor"], 0)
    assert json.loads(r.stdout)["targets"] == ["co-c"]
    signals = {s.id: s for s in read_signals(dht, "local-cpu", "body-1")}
    assert signals[out["signal"]].targets == ["op-a", "op-b"] and len(signals) == 2


def test_preempt_with_nobody_eligible_is_a_runtime_error(preempts):
    r = exits(preempts["nobody"], 1)
    assert "no live worker of stage tail" in r.stderr and len(r.stderr.strip().splitlines()) == 2


@pytest.mark.parametrize("i, args, message", [(i, a, m) for i, (a, m) in enumerate(USAGE)])
def test_usage_errors(preempts, i, args, message):
    r = exits(preempts[f"usage{i}"], 2)
    assert message in r.stderr


def test_churn_names_a_bad_stage_among_several(preempts):
    r = exits(preempts["churn-stage"], 2)
    assert "--stage nope: no such stage" in r.stderr and len(r.stderr.strip().splitlines()) <= 2
