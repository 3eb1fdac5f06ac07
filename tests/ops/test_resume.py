"""Planning a launch from its checkpoint store (agoractl.ops.resume): the pure decision, then a real
local store (identity binding, incomplete checkpoints, moving aside), then the one-line refusals of
``launch swarm`` / ``launch worker`` / ``launch central`` as a user sees them (real subprocesses; no
swarm is started: the refusals come first). CPU only, no network."""

from __future__ import annotations

import json

import pytest
import torch

from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.loader import load_manifest
from agoractl.ops import resume
from agoractl.ops.checkpoint import CheckpointStore
from tests.conftest import MANIFESTS, private_shards

MANIFEST = MANIFESTS / "local-cpu.yaml"
HERE = {"name": "local-cpu", "hash": "aaaa"}
STAGES = ["head", "body-1", "tail"]


def decide(complete, there=HERE, **kw):
    return resume.decide(HERE, there, complete, STAGES, kw.pop("max_steps", 60), "file:///s", **kw)


def test_decide_resumes_from_the_newest_step_complete_for_every_stage():
    assert decide({}) == (0, "new")
    assert decide({s: [20, 40] for s in STAGES}) == (40, "resume")
    # The tail's step-40 publisher was killed before meta.json: the run falls back to 20 everywhere.
    assert decide({"head": [20, 40], "body-1": [20, 40], "tail": [20]}) == (20, "resume")
    assert decide({s: [20, 40] for s in STAGES}, resume_step=20) == (20, "resume")
    assert decide({s: [20] for s in STAGES}, there=HERE, fresh=True, force=True) == (0, "start-over")
    assert decide({}, there=None, fresh=True) == (0, "new")
    assert decide({s: [20] for s in STAGES}, until=40) == (20, "resume")  # a launch stopping at 40


@pytest.mark.parametrize("kw, error, words", [
    ({"there": {"name": "other", "hash": "bbbb"}}, UsageError, "belongs to run other"),
    ({"there": {"name": "local-cpu", "hash": "cccc"}}, UsageError, "belongs to run local-cpu"),
    ({"there": None}, UsageError, "record no run identity"),
    ({"max_steps": 40}, UsageError, "already complete"),
    ({"max_steps": 30}, UsageError, "beyond training.max_steps"),
    ({"fresh": True}, UsageError, "--fresh starts over only in an empty store"),
    ({"resume_step": 30}, UsageError, "no checkpoint at that step"),
    ({"resume_step": 80}, UsageError, "beyond training.max_steps"),
    ({"until": 40}, UsageError, "already reached step 40"),
])
def test_decide_refuses_in_one_line(kw, error, words):
    with pytest.raises(error) as e:
        decide({s: [20, 40] for s in STAGES}, **kw)
    assert words in e.value.message and "\n" not in e.value.message and e.value.hint


def test_decide_names_the_stages_missing_from_an_incomplete_step():
    complete = {"head": [20, 40], "body-1": [20, 40], "tail": [20]}
    with pytest.raises(RuntimeFailure, match="step 40 is incomplete: stage\\(s\\) tail"):
        decide(complete, resume_step=40)
    with pytest.raises(RuntimeFailure, match="no checkpoint step is complete for every stage"):
        decide({"head": [40], "body-1": [40], "tail": [20]})
    assert decide(complete, force=True) == (20, "resume")  # --force skips only the identity check


def test_identity_ignores_max_steps_but_not_the_model_or_data_order():
    base = load_manifest(MANIFEST, [])
    for same in ("training.max_steps=999", "training.until_step=20"):
        assert resume.identity(base) == resume.identity(load_manifest(MANIFEST, [same])), same
    for change in ("model.d_model=32", "data.seed=7", "trainers.count=3", "metadata.name=x"):
        assert resume.identity(load_manifest(MANIFEST, [change])) != resume.identity(base), change


def _publish(url, run, stages, step):
    store = CheckpointStore(url, 3)
    for s in stages:
        store.publish(s, step, {"w": torch.ones(2)}, None, {"run": resume.identity(run)})
    return store


def test_plan_binds_checks_files_and_moves_aside(tmp_path):
    url = str(tmp_path / "store")
    run = load_manifest(MANIFEST, [f"checkpoints.store={url}"])
    first = resume.plan(run)
    assert first.action == "new" and first.binding
    assert json.loads((tmp_path / "store" / "RUN.json").read_text())["hash"] == resume.identity(run)["hash"]
    _publish(url, run, run.stage_names(), 20)
    assert resume.plan(run).step == 20

    (tmp_path / "store/checkpoints/tail/step-00000020/model.safetensors").unlink()  # a damaged checkpoint
    with pytest.raises(RuntimeFailure, match="tail/step-00000020/model.safetensors: the checkpoint at step 20 is "
                                             "incomplete \\(missing\\)"):
        resume.plan(run)

    other = load_manifest(MANIFEST, [f"checkpoints.store={url}", "metadata.name=other"])
    with pytest.raises(UsageError, match="belongs to run local-cpu"):
        resume.plan(other)
    over = resume.plan(other, fresh=True, force=True)
    assert over.action == "start-over" and over.step == 0
    aside = list((tmp_path / "store" / "aside").iterdir())
    assert len(aside) == 1 and (aside[0] / "checkpoints" / "head" / "step-00000020" / "meta.json").exists()
    assert json.loads((aside[0] / "RUN.json").read_text())["name"] == "local-cpu"
    assert not (tmp_path / "store" / "checkpoints").exists()
    assert json.loads((tmp_path / "store" / "RUN.json").read_text())["name"] == "other"


def test_resume_sets_the_abandoned_later_steps_aside(tmp_path):
    url = str(tmp_path / "store")
    run = load_manifest(MANIFEST, [f"checkpoints.store={url}"])
    resume.plan(run)
    _publish(url, run, run.stage_names(), 20)
    _publish(url, run, ["head", "body-1"], 40)  # the tail's publisher was killed before its step 40
    (tmp_path / "store/checkpoints/tail/step-00000040").mkdir()  # ... leaving a directory without meta.json
    p = resume.plan(run)
    assert (p.step, p.action) == (20, "resume") and p.moved_aside and "moved" in p.describe()
    for stage in ("head", "body-1", "tail"):
        assert CheckpointStore(url, 3).latest_step(stage) == 20
        assert not (tmp_path / "store/checkpoints" / stage / "step-00000040").exists()
        assert (tmp_path / "store/aside").glob(f"*/checkpoints/{stage}/step-00000040")
    assert len(list((tmp_path / "store/aside").glob("*/checkpoints/*/step-00000040/meta.json"))) == 2
    assert resume.plan(run).moved_aside is None  # nothing left to move


def _foreign_store(tmp_path):
    url = str(tmp_path / "store")
    other = load_manifest(MANIFEST, [f"checkpoints.store={url}", "metadata.name=someone-else"])
    resume.plan(other)
    _publish(url, other, other.stage_names(), 20)
    return url


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_launch_refuses_another_runs_store_with_exit_2_and_writes_nothing(cli, tmp_path):
    url = _foreign_store(tmp_path)
    before = _tree(tmp_path / "store")
    sets = ["--set", f"checkpoints.store={url}", "--set", f"local.run_dir={tmp_path / 'run'}"]
    swarm, trainer, fresh, both = cli.batch(["launch", "swarm", MANIFEST, *sets],
                                            ["launch", "trainer", MANIFEST, *sets],
                                            ["launch", "swarm", MANIFEST, *sets, "--fresh"],
                                            ["launch", "swarm", MANIFEST, *sets, "--resume-step", "10", "--fresh"])
    for proc in (swarm, trainer):
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert lines[0].startswith("error: ") and "belongs to run someone-else" in lines[0], proc.stderr
        assert len(lines) <= 2 and "Traceback" not in proc.stderr  # the line and its hint
    assert _tree(tmp_path / "store") == before and not (tmp_path / "run").exists()

    proc = fresh
    assert proc.returncode == 2 and "--fresh starts over only in an empty store" in proc.stderr, proc.stderr
    proc = both
    assert proc.returncode == 2 and "exclude each other" in proc.stderr, proc.stderr
    assert _tree(tmp_path / "store") == before


def test_central_refusals_and_fresh_force_keep_the_old_checkpoints(cli, tmp_path, sample_shards):
    url = str(tmp_path / "store")
    mine = load_manifest(MANIFEST, [f"checkpoints.store={url}"])
    other = load_manifest(MANIFEST, [f"checkpoints.store={url}", "metadata.name=someone-else"])
    store = resume.central_store(mine)
    resume.plan(other, store, [resume.CENTRAL_STAGE])
    _publish(store.url, other, [resume.CENTRAL_STAGE], 20)
    before = _tree(tmp_path / "store")
    sets = [a for v in private_shards(sample_shards, tmp_path) + [f"checkpoints.store={url}", "model.seq_len=32",
                                                                    f"local.run_dir={tmp_path / 'run'}"]
            for a in ("--set", v)]
    proc = cli("launch", "central", MANIFEST, *sets, check=2)
    assert proc.stderr.startswith("error: ") and "belongs to run someone-else" in proc.stderr.splitlines()[0]
    assert _tree(tmp_path / "store") == before and not (tmp_path / "run").exists()
    proc, fresh = cli.batch(["launch", "central", MANIFEST, *sets, "--resume-step", "20", "--force"],
                            ["launch", "central", MANIFEST, *sets, "--fresh", "--force", "--until-step", "1", "--json"])
    assert proc.returncode == 1, proc.stderr
    assert "does not fit this stage" in proc.stderr  # --force adopts the store; the tensors still must fit

    proc = fresh
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["resume"]["action"] == "start-over" and report["steps"] == 1
    aside = report["resume"]["moved_aside"]
    assert (tmp_path / "store" / "central" / "aside").exists() and aside.endswith(tuple(
        p.name for p in (tmp_path / "store" / "central" / "aside").iterdir()))
    assert json.loads(next((tmp_path / "store/central/aside").glob("*/RUN.json")).read_text())["name"] == \
        "someone-else"
    assert resume.central_store(mine).steps(resume.CENTRAL_STAGE) == [1]
