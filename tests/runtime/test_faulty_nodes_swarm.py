"""Faulty nodes in a real swarm (issue 25): a replicated swarm (``launch swarm``: DHT seed, 3 stages x 2
workers, 2 trainers, each its own process over loopback libp2p) is joined by three ordinary
``launch worker`` processes made faulty with the hidden ``--fault`` drill (correct for their first few
batches, then): a head whose outputs are finite but x1e6, a body whose outputs are NaN, and a tail
whose backward (losses, input gradient and its own parameter gradients) is NaN.

One swarm serves every check: the run reaches ``training.max_steps`` with no sample lost; no honest
worker terminates or is ever penalised (each took every step; none exited under a self-termination rule); each faulty worker is
rejected by the trainers within a few of its requests (the faults of the run report, per worker);
honest workers refuse nothing (no bad value ever reached them); the x1e6 head, rejected by both
trainers, ends itself under ``refused_outputs`` and the NaN tail under its own ``nan_gradients``.
Marked ``swarm``; about two minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from agoractl.algorithms.termination import EXIT_CODES

from tests.runtime.test_swarm import (MANIFEST, TINY, agoractl, by_stage, corpus, finish, procs, run_swarm,  # noqa: F401
                                      sets, wait_status)

pytestmark = pytest.mark.swarm
FAULTY = {"head": "huge-outputs", "body-1": "nan-outputs", "tail": "nan-grads"}
IN_FLIGHT = 4
STEPS = 80
"""Steps of 4 samples; the trainers wait for the faulty workers too (local.start_with_workers=3: on a loaded CI
machine they were otherwise ready only near the end of the run)."""


def test_faulty_workers_are_banned_and_honest_ones_train_on(corpus, procs, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    values = corpus + TINY + ["local.workers_per_stage=2", "local.trainers=2", "trainers.count=2",
                              f"trainers.in_flight={IN_FLIGHT}", f"training.max_steps={STEPS}",
                              "training.global_batch_size=4",
                              "validation.warmup=3",  # per trainer and stage
                              "workers.self_termination.refused_outputs=2",  # one notice from each trainer
                              "local.start_with_workers=3",  # 2 honest + 1 faulty per stage before the first sample
                              f"checkpoints.store={tmp_path / 'store'}"]  # the faulty workers' too: never the checkout's
    p, status = run_swarm(procs, run_dir, values)
    s = wait_status(status, p, lambda s: s.get("maddrs"))  # the seed is up: start beside the swarm's workers
    faulty = {}
    for stage, fault in FAULTY.items():
        faulty[stage] = procs.start(
            agoractl("launch", "worker", str(MANIFEST), *sets(values), "--stage", stage, "--fault", fault,
                     "--initial-peers", s["maddrs"][0], "--stats", str(tmp_path / f"{fault}.json")),
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{fault}.err", "wb"))
    # Every faulty worker is up while the run is still going (else the test proves nothing).
    def all_ready(s) -> bool:
        return all(ready_peer(tmp_path / f"{f}.err", None) for f in FAULTY.values()) or s["step"] >= STEPS - 20

    assert wait_status(status, p, all_ready, timeout=300)["step"] < STEPS - 20, "the faulty workers came up too late"
    r = finish(p, run_dir)
    faulty_peers = {stage: ready_peer(tmp_path / f"{fault}.err") for stage, fault in FAULTY.items()}

    assert r["steps"] == STEPS and r["completed"], r["steps"]
    assert r["samples_lost"] == 0
    honest = {w["peer"] for w in r["workers"]} - set(faulty_peers.values())
    assert len(honest) == 6
    for name, code in r["exit_codes"].items():  # no node the swarm started terminated itself
        assert code not in EXIT_CODES.values(), (name, code)
    for w in (w for w in r["workers"] if w["peer"] in honest):
        assert w["step"] == STEPS and not w.get("termination") and w["refused"] == 0, w
        assert w["checks_s"] > 0, w  # what its checks of requests cost
    assert all(t["checks_s"] > 0 for t in r["trainers"]), r["trainers"]  # and the trainers' of replies
    faults = r["faults"]
    assert not honest & set(faults), faults  # no honest worker was ever penalised
    drilled = [w for w in r["workers"] if w["peer"] in faulty_peers.values()]  # faulty only after fault_drill.ONSET
    assert set(faults) == set(faulty_peers.values()), (faults, drilled)  # every faulty worker was caught ...
    for stage, peer in faulty_peers.items():
        entry = faults[peer]
        assert entry["stage"] == stage and (stage == "tail" or entry["trainers"] == 2), entry  # by every trainer
        rejected = sum(v for k, v in entry.items() if k not in ("stage", "trainers"))
        assert 1 <= rejected <= entry["trainers"] * IN_FLIGHT, entry  # ... within a few of its requests
        reason = "magnitude" if FAULTY[stage] == "huge-outputs" else "non_finite"
        assert entry.get(reason), entry
    stages = by_stage(r)
    assert sum(s["rejected"] for s in stages.values()) == sum(
        sum(v for k, v in e.items() if k not in ("stage", "trainers")) for e in faults.values())

    # Workers whose outputs both trainers refused learned it from their notices and left (refused_outputs);
    # the tail whose backward is NaN left at the first of that rule or its own nan_gradients (a broken GPU).
    for stage, fault in FAULTY.items():
        rules = ("refused_outputs", "nan_gradients") if stage == "tail" else ("refused_outputs",)
        code = faulty[stage].wait(120)
        assert code in [EXIT_CODES[r] for r in rules], (stage, code, (tmp_path / f"{fault}.err").read_text()[-2000:])
        assert json.loads((tmp_path / f"{fault}.json").read_text())["termination"]["rule"] in rules


def ready_peer(log: Path, missing: object = AssertionError) -> str:
    """The peer id a worker announced in its "worker ready" log line (`missing` if none yet: raised if an
    exception class)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    for line in text.splitlines():
        if '"worker ready"' in line:
            return json.loads(line)["peer"]
    if isinstance(missing, type) and issubclass(missing, BaseException):
        raise missing(f"{log.name}: the worker never got ready")
    return missing
