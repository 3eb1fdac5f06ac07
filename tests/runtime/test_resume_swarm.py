"""A whole swarm resumes from its store after every process was SIGKILLed mid-run (issue 21): one real
multi-process swarm on loopback (DHT seed, 3 stages x 1 worker, 1 trainer), killed once a checkpoint
is complete for every stage, then the same command again. Checked: the second run resumes from the
newest complete checkpoint and reaches max_steps; every worker loaded that step; the trainer read on
from its data position at that step, so no sequence is trained twice (from the trainer's own records);
the loss continues the curve rather than restarting near ln(257). Marked ``swarm`` (slow)."""

from __future__ import annotations

import json
import math
import signal
import time

import pytest

from tests.runtime.test_swarm import TINY, Procs, corpus, finish, procs, run_swarm  # noqa: F401 (fixtures)

pytestmark = pytest.mark.swarm
STEPS, EVERY = 10, 2


def complete_steps(store, stages=("head", "body-1", "tail")) -> set[int]:
    found = [{int(d.name[5:]) for d in (store / "checkpoints" / s).glob("step-*") if (d / "meta.json").exists()}
             for s in stages]
    return set.intersection(*found)


def test_sigkilled_swarm_resumes_from_the_last_complete_checkpoint(corpus, procs: Procs, tmp_path):
    run_dir = tmp_path / "run"
    store, positions = run_dir / "store", tmp_path / "shards" / "progress" / "checkpoints-00000.json"
    values = corpus + TINY + ["local.workers_per_stage=1", "local.trainers=1", "trainers.count=1",
                              f"training.max_steps={STEPS}", f"checkpoints.every_steps={EVERY}",
                              "checkpoints.keep_last=3", "trainers.record_sequences=true"]
    first, status = run_swarm(procs, run_dir, values)
    deadline = time.monotonic() + 300
    while True:  # a checkpoint complete for every stage, and the trainer's data position at it
        assert first.poll() is None and time.monotonic() < deadline, "the first run never reached step 4"
        try:
            recorded = set(map(int, json.loads(positions.read_text())["positions"]))
        except (OSError, ValueError, KeyError):
            recorded = set()
        if {s for s in complete_steps(store) if s >= 4} & recorded:
            break
        time.sleep(0.2)
    procs.kill_all()  # SIGKILL: the launcher's process group, then every node's (from status.json)
    assert first.returncode == -signal.SIGKILL
    resumed_at = max(complete_steps(store) & set(map(int, json.loads(positions.read_text())["positions"])))
    assert resumed_at < STEPS
    at = {h["shard"]: h["consumed"] for h in json.loads(positions.read_text())["positions"][str(resumed_at)]["holdings"]}
    last_status = json.loads(status.read_text())

    second, _ = run_swarm(procs, run_dir, values)
    r = finish(second, run_dir)
    assert r["resume"]["action"] == "resume" and r["resume"]["step"] >= resumed_at
    resumed_at = r["resume"]["step"]  # a publish may have completed between our look and the kill
    assert r["completed"] and all(w["step"] == STEPS for w in r["workers"]), r["workers"]
    assert {w["resumed"]["loaded_step"] for w in r["workers"]} == {resumed_at}
    (trainer,) = r["trainers"]
    assert trainer["resumed"] == {"step": resumed_at, "source": "checkpoint"}

    # No sequence trained twice: the second part reads on from the position recorded at the step.
    at = {h["shard"]: h["consumed"] for h in json.loads(positions.read_text())["positions"][str(resumed_at)]["holdings"]}
    seqs = [tuple(s[:3]) for s in trainer["sequences"]]
    assert seqs and len(seqs) == len(set(seqs))
    assert all(offset >= at.get(shard, 0) for shard, _, offset in seqs), (at, seqs[:5])
    assert min(s[3] for s in trainer["sequences"]) >= resumed_at

    # The loss continues the curve: well below an untrained model's ln(257) from the first resumed step.
    losses = dict((int(s), v) for s, v in r["loss"])
    assert min(losses) >= resumed_at
    assert losses[min(losses)] < math.log(257) - 0.3, (losses, last_status.get("loss"))
