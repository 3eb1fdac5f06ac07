"""Export to Hugging Face (agoractl.ops.export, `agoractl export`) and held-out perplexity
(agoractl.ops.evaluate, `agoractl eval`): a trained central run, SSN and dense boundaries, loaded with
transformers offline, the same logits and greedy continuation as agoractl's own model; lm-eval on a
local task agrees with `agoractl eval`; bad sources write nothing. The swarm's export is checked on the
SPARTA scenario's store (tests/runtime/test_sparta_swarm.py), with :func:`assert_export_matches`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import safetensors.torch
import torch

from agoractl.manifest.loader import load_manifest
from agoractl.model.build import build_model
from agoractl.model.llama import greedy
from agoractl.ops.checkpoint import CheckpointStore
from agoractl.ops.export import load_exported, state_from_central
from tests.conftest import MANIFESTS, cli_batch, private_shards

MANIFEST = MANIFESTS / "local-cpu.yaml"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TINY = ["training.global_batch_size=4", "trainers.microbatch=1",
        "training.max_steps=3", "training.schedule.warmup_steps=1"]


def agoractl(*args: str, check: int | None = 0, env: dict | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "agoractl", *args], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **OFFLINE, **(env or {})}, cwd=tempfile.mkdtemp(prefix="export-cwd-"))
    if check is not None:
        assert out.returncode == check, out.stderr[-3000:]
    return out


def sets(values) -> list[str]:
    return [a for v in values for a in ("--set", v)]


def assert_export_matches(values: list[str], model: torch.nn.Module, to: Path, *extra: str,
                          manifest: Path = MANIFEST) -> Path:
    """`agoractl export` with `values`, then transformers' model gives `model`'s next-token logits
    (max abs difference <= 1e-4, fp32) and its greedy continuation of 32 tokens."""
    agoractl("export", str(manifest), *sets(values), "--to", str(to), *extra)
    return assert_exported_matches(model, to)


def assert_exported_matches(model: torch.nn.Module, to: Path) -> Path:
    """The export in `to` gives `model`'s next-token logits and greedy continuation (see above)."""
    hf = load_exported(to)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(to), local_files_only=True)
    text = "The pipeline stages are replicated on many workers."
    ids = tok.encode(text)
    assert ids == list(text.encode())  # the bytes tokenizer, exported
    x = torch.tensor([ids])
    model.eval()
    with torch.no_grad():
        diff = (model(x) - hf(x).logits).abs().max().item()
    assert diff <= 1e-4, diff
    prompt = ids[:16]
    mine = greedy(model, prompt, 32, eos=tok.eos_token_id)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    assert theirs == mine and len(mine) >= 1
    return to


@pytest.fixture(scope="module")
def corpus(sample_shards, tmp_path_factory):
    return private_shards(sample_shards, tmp_path_factory.mktemp("export"))


def _central(corpus: list[str], tmp: Path, rank: str, *more: list[str]) -> tuple[list[str], Path, list]:
    """`launch central` (3 steps) and `export --from central`, then the invocations `more` (given the values),
    one after another in one interpreter (``cli_batch``); the values, the exported directory and `more`'s
    results."""
    values = corpus + TINY + [f"model.ssn.rank={rank}", f"local.run_dir={tmp / 'run'}", f"checkpoints.store={tmp / 'store'}"]
    launch, export, *rest = cli_batch(
        [["launch", "central", str(MANIFEST), *sets(values), "--json"],
         ["export", str(MANIFEST), *sets(values), "--to", str(tmp / "hf"), "--from", "central"],
         *(m(values) for m in more)], cwd=tempfile.mkdtemp(prefix="export-cwd-"), env=OFFLINE, timeout=900)
    assert launch.returncode == 0, launch.stderr[-3000:]
    assert export.returncode == 0, export.stderr[-3000:]
    run = load_manifest(MANIFEST, values)
    step, state = state_from_central(run)
    assert step == 3
    model = build_model(run)
    model.load_state_dict(state)
    out = assert_exported_matches(model, tmp / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["agoractl"]["step"] == 3 and config["num_key_value_heads"] == run.model.kv_heads
    return values, out, rest


@pytest.fixture(scope="module")
def central_ssn(corpus, tmp_path_factory):
    """The SSN central run and its export; also `agoractl eval` of the export (--limit 4, --write-task)."""
    tmp = tmp_path_factory.mktemp("central-ssn")
    evaluate = lambda values: ["eval", str(MANIFEST), *sets(values), "--model", str(tmp / "hf"), "--limit", "4",
                               "--write-task", str(tmp / "task"), "--json"]
    values, out, (ev,) = _central(corpus, tmp, "16", evaluate)
    return values, out, ev, tmp / "task"


def test_central_run_exports_to_the_same_model_ssn(central_ssn):
    values, out, _, _ = central_ssn
    assert json.loads((out / "config.json").read_text())["agoractl"]["ssn_rank"] == 16


def test_central_run_exports_to_the_same_model_dense(corpus, tmp_path):
    values, out, _ = _central(corpus, tmp_path, "null")
    assert json.loads((out / "config.json").read_text())["agoractl"]["ssn_rank"] is None


@pytest.mark.timeout(900)
def test_eval_matches_lm_eval_on_a_local_task(central_ssn, tmp_path):
    """agoractl eval and lm-eval-harness score the same held-out documents: perplexities within 1%."""
    values, hf, ev, task = central_ssn
    assert ev.returncode == 0, ev.stderr[-3000:]
    ours = json.loads(ev.stdout)
    code = ("import json, lm_eval; from lm_eval.tasks import TaskManager; "
            f"r = lm_eval.simple_evaluate(model='hf', model_args='pretrained={hf},dtype=float32', "
            f"tasks=['agoractl_heldout'], task_manager=TaskManager(include_path={str(task)!r}), "
            "batch_size=1, device='cpu'); print(json.dumps(r['results']['agoractl_heldout']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=800,
                         env={**os.environ, **OFFLINE}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    byte_ppl = theirs["byte_perplexity,none"]
    assert ours["documents"] == 4 and ours["tokens"] > 0
    assert abs(byte_ppl - ours["byte_perplexity"]) / ours["byte_perplexity"] < 0.01, (byte_ppl, ours)


def _publish(store: Path, stage: str, step: int, model: torch.nn.Module, names: list[str]) -> None:
    state = {n: t for n, t in model.state_dict().items() if n in names}
    CheckpointStore(str(store)).publish(stage, step, state)


def test_refusals_write_nothing(tmp_path):
    """Stages at different steps, a missing stage, a surrogate manifest: one line, exit 1 or 2, --to untouched.
    One store lacks the last stage; in another the first stage is also at step 12 and the others only at 10.
    The exports run one after another in one interpreter (``cli_batch``), each with its own --to."""
    store, partial = tmp_path / "store", tmp_path / "partial"
    values = [f"checkpoints.store={store}", f"local.run_dir={tmp_path / 'run'}"]
    run = load_manifest(MANIFEST, values)
    from agoractl.model.build import stage_parameter_names

    model = build_model(run)
    names = run.stage_names()
    to = tmp_path / "hf"
    for i, stage in enumerate(names[:-1]):
        _publish(store, stage, 10, model, stage_parameter_names(run, i))
    shutil.copytree(store, partial)
    _publish(store, names[-1], 10, model, stage_parameter_names(run, len(names) - 1))
    _publish(store, names[0], 12, model, stage_parameter_names(run, 0))
    surrogate = (["export", str(MANIFESTS / "surrogate-cpu.yaml"), "--to", str(tmp_path / "s")]
                 if (MANIFESTS / "surrogate-cpu.yaml").exists() else
                 ["export", str(MANIFEST), *sets(values + ["model.family=surrogate"]), "--to", str(tmp_path / "s")])
    missing, steps, at12, ok, full, surr = cli_batch(
        [["export", str(MANIFEST), *sets(values + [f"checkpoints.store={partial}"]), "--to", str(tmp_path / "hf-1")],
         ["export", str(MANIFEST), *sets(values), "--to", str(tmp_path / "hf-2")],
         ["export", str(MANIFEST), *sets(values), "--to", str(tmp_path / "hf-3"), "--step", "12"],
         ["export", str(MANIFEST), *sets(values), "--to", str(to), "--step", "10"],
         ["export", str(MANIFEST), *sets(values), "--to", str(to), "--step", "10"],
         surrogate], cwd=tempfile.mkdtemp(prefix="export-cwd-"), env=OFFLINE, timeout=600)
    assert missing.returncode == 1, missing.stderr
    assert f"no checkpoint of stage {names[-1]}" in missing.stderr and "Traceback" not in missing.stderr
    assert len(missing.stderr.strip().splitlines()) <= 2 and not (tmp_path / "hf-1").exists()
    assert steps.returncode == 1, steps.stderr
    assert "different steps" in steps.stderr and "--step 10" in steps.stderr and not (tmp_path / "hf-2").exists()
    assert at12.returncode == 1, at12.stderr
    assert f"has no checkpoint at step 12" in at12.stderr and not (tmp_path / "hf-3").exists()
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (to / "model.safetensors").is_file() and (to / "tokenizer.json").is_file()
    assert full.returncode == 2, full.stderr
    assert "not an empty directory" in full.stderr
    assert surr.returncode == 2, surr.stderr
    assert "surrogate" in surr.stderr and not (tmp_path / "s").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_large_state_is_sharded(tmp_path):
    run = load_manifest(MANIFEST, [])
    from agoractl.ops.export import write_export

    out = write_export(run, build_model(run).state_dict(), 0, tmp_path / "hf", "test", max_shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((out / f).is_file() for f in files)
    loaded = {}
    for f in files:
        loaded.update(safetensors.torch.load_file(str(out / f)))
    assert set(loaded) == set(index["weight_map"])
    model = build_model(run)
    hf = load_exported(out)
    x = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        assert (model.eval()(x) - hf(x).logits).abs().max().item() <= 1e-4
