"""A whole swarm resumes from its store (issue 21): real multi-process swarms on loopback (DHT seed,
3 stages x 1 worker, 1 trainer, one sample in flight), run once per module and shared by the tests.

- ``resumed``: a launch with ``--until-step HALF`` is SIGKILLed (the launcher's process group and every
  node's) once a checkpoint is complete for every stage; the same command resumes from the newest
  complete checkpoint and stops after step HALF. The second test then launches the command without
  ``--until-step``, which resumes from HALF to STEPS.
- ``uninterrupted``: the same manifest, seed and data in one launch to STEPS. It is also the pure
  pipeline (one worker per stage, one trainer) compared with ``launch central`` on the same values.
Each resume test runs two launches (the first test's, its fixture's; the second, the uninterrupted one and
the last part).

Checked: the SIGKILLed run resumes from its last complete checkpoint (weights and data position) and
reaches its last step; no sequence is trained twice across the parts (from the trainers' records); the
loss of the first resumed step (step HALF+1, 0-based HALF) continues the curve, within the uninterrupted
run's own step-to-step noise there; the final loss (the run report's: the mean of the last 5 steps) is
within 1% of the uninterrupted run's. With one sample in flight the pipeline's order is fixed, so the
two runs differ only by the samples in flight at each stop (read past, never trained). Marked ``swarm``.
"""

from __future__ import annotations

import collections
import json
import math
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

from tests.conftest import private_shards
from tests.runtime.test_swarm import MANIFEST, TINY, Procs, agoractl, finish, run_swarm, sets

pytestmark = pytest.mark.swarm
STEPS, HALF, EVERY = 20, 10, 2


def values(tmp, sample_shards) -> list[str]:
    return private_shards(sample_shards, tmp) + TINY + [
        "local.workers_per_stage=1", "local.trainers=1", "trainers.count=1", "trainers.in_flight=1",
        f"training.max_steps={STEPS}", f"checkpoints.every_steps={EVERY}", "checkpoints.keep_last=3",
        "trainers.record_sequences=true"]


def complete_steps(store, stages=("head", "body-1", "tail")) -> set[int]:
    found = [{int(d.name[5:]) for d in (store / "checkpoints" / s).glob("step-*") if (d / "meta.json").exists()}
             for s in stages]
    return set.intersection(*found)


def holdings_at(positions, step: int) -> dict[int, int]:
    return {h["shard"]: h["consumed"] for h in json.loads(positions.read_text())["positions"][str(step)]["holdings"]}


def launch(run_dir, vals, extra=()) -> dict:
    """One launch to its end (every process it started killed afterwards, even on failure): its report."""
    procs = Procs()
    try:
        return finish(run_swarm(procs, run_dir, vals, extra=extra)[0], run_dir)
    finally:
        procs.kill_all()


@pytest.fixture(scope="module")
def resumed(sample_shards, tmp_path_factory) -> SimpleNamespace:
    """SIGKILLed mid-run, then the same command: resumed, it stops after step HALF."""
    tmp = tmp_path_factory.mktemp("resumed")
    run_dir = tmp / "run"
    store, positions = run_dir / "store", tmp / "shards" / "progress" / "checkpoints-00000.json"
    vals = values(tmp, sample_shards)
    until = ["--until-step", str(HALF)]
    procs = Procs()
    try:
        first, status = run_swarm(procs, run_dir, vals, extra=until)
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
    finally:
        procs.kill_all()  # SIGKILL: the launcher's process group, then every node's (from status.json)
    recorded = set(map(int, json.loads(positions.read_text())["positions"]))
    killed = SimpleNamespace(returncode=first.returncode, status=json.loads(status.read_text()),
                             at=max(complete_steps(store) & recorded))
    second = launch(run_dir, vals, until)
    return SimpleNamespace(killed=killed, second=second, at_second=holdings_at(positions, second["resume"]["step"]),
                           run_dir=run_dir, values=vals, positions=positions)


@pytest.fixture(scope="module")
def uninterrupted(sample_shards, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return launch(tmp / "run", values(tmp, sample_shards))


def test_pure_pipeline_matches_the_centralized_reference(uninterrupted, sample_shards, tmp_path):
    """One worker per stage, one trainer (the uninterrupted run): after the same tokens the loss is within
    3% of launch central's (same seed, same data, same values)."""
    r = uninterrupted
    central = subprocess.run(agoractl("launch", "central", str(MANIFEST), *sets(values(tmp_path, sample_shards) + [
        f"local.run_dir={tmp_path / 'run'}", f"checkpoints.store={tmp_path / 'cs'}"]), "--json"),
                             capture_output=True, text=True, timeout=300)
    assert central.returncode == 0, central.stderr
    c = json.loads(central.stdout)
    assert r["steps"] == c["steps"] == STEPS and r["tokens"] == c["tokens"]
    assert abs(r["final_loss"] - c["final_loss"]) / c["final_loss"] < 0.03, (r["final_loss"], c["final_loss"])
    assert len(r["loss"]) == STEPS and [s for s, _ in r["loss"]] == list(range(STEPS))


def sequences(report) -> list[tuple]:
    (trainer,) = report["trainers"]
    return [tuple(s) for s in trainer["sequences"]]


def reads_on(seqs, step: int, at: dict[int, int]) -> bool:
    """Every sequence trained at `step` or later, from the data position `at` on."""
    return bool(seqs) and all(s[3] >= step and s[2] >= at.get(s[0], 0) for s in seqs)


def test_sigkilled_swarm_resumes_from_the_last_complete_checkpoint(resumed):
    assert resumed.killed.returncode == -signal.SIGKILL and resumed.killed.at < HALF
    r = resumed.second
    assert r["resume"]["action"] == "resume" and r["resume"]["step"] >= resumed.killed.at
    at = r["resume"]["step"]  # a publish may have completed between our look and the kill
    assert r["completed"] and r["until_step"] == HALF and r["end_reason"] == f"until_step reached (step {HALF})"
    assert all(w["step"] == HALF for w in r["workers"]), r["workers"]
    assert {w["resumed"]["loaded_step"] for w in r["workers"]} == {at}
    (trainer,) = r["trainers"]
    assert trainer["resumed"] == {"step": at, "source": "checkpoint"}
    # No sequence trained twice: the resumed part reads on from the position recorded at the step.
    seqs = sequences(r)
    assert len(seqs) == len({s[:3] for s in seqs}) and reads_on(seqs, at, resumed.at_second), seqs[:5]
    # Every resumed step took one global batch (the first one too: the stages count from the checkpoint).
    per_step = collections.Counter(s[3] for s in seqs)
    assert all(per_step[step] == 8 for step in range(at, HALF)), per_step
    # The loss continues the curve: well below an untrained model's ln(257) from the first resumed step.
    losses = dict((int(s), v) for s, v in r["loss"])
    assert min(losses) == at and losses[at] < math.log(257) - 0.3, (losses, resumed.killed.status.get("loss"))


def test_swarm_run_in_two_parts_continues_the_uninterrupted_curve(resumed, uninterrupted):
    """HALF steps (--until-step), then the command without it to STEPS: the resumed part starts where the
    first stopped and ends as one uninterrupted launch does; no sequence is trained twice across the parts."""
    before, whole = resumed.second, uninterrupted
    at_half = holdings_at(resumed.positions, HALF)  # before the last part's checkpoints evict it
    after = launch(resumed.run_dir, resumed.values)
    assert after["resume"] | {"action": "resume", "step": HALF} == after["resume"]
    assert after["completed"] and after["steps"] == STEPS and after["until_step"] is None
    assert {w["resumed"]["loaded_step"] for w in after["workers"]} == {HALF}
    first, second = sequences(before), sequences(after)
    assert reads_on(second, HALF, at_half)
    # Records of step HALF in the first part are of samples drawn before it stopped, never applied.
    assert not {s[:3] for s in first if s[3] < HALF} & {s[:3] for s in second}
    assert len(second) == len({s[:3] for s in second})
    # One sample in flight: the resumed part trains exactly the sequences of the uninterrupted run's steps.
    assert second == [s for s in sequences(whole) if s[3] >= HALF], (second[:3], sequences(whole)[:3])

    mine = {int(s): v for s, v in [*before["loss"], *after["loss"]]}
    ref = {int(s): v for s, v in whole["loss"]}
    assert sorted(ref) == list(range(STEPS)) and set(range(HALF - 1, STEPS)) <= set(mine)
    # The run's own step-to-step noise around HALF: the uninterrupted run's largest step-to-step change
    # over the 4 steps either side.
    noise = max(abs(ref[i + 1] - ref[i]) for i in range(HALF - 4, HALF + 4))
    print(f"two parts: step {HALF - 1} {mine[HALF - 1]:.4f}, step {HALF} {mine[HALF]:.4f}, final "
          f"{after['final_loss']:.4f}; uninterrupted: {ref[HALF - 1]:.4f}, {ref[HALF]:.4f}, final "
          f"{whole['final_loss']:.4f}; noise {noise:.4f}; ratio {after['final_loss'] / whole['final_loss']:.5f}")
    assert abs(mine[HALF] - ref[HALF]) <= noise, (mine[HALF], ref[HALF], noise)
    assert abs(mine[HALF] - mine[HALF - 1]) <= noise, (mine, ref)
    assert after["final_loss"] == pytest.approx(whole["final_loss"], rel=0.01), (after["loss"], whole["loss"])
