"""`agoractl shard` as a real subprocess: JSON output, bad input (one line, exit 1, no index), and a
SIGKILL part-way through followed by a rerun. Local files in tmp_path; S3 is in tests/data/test_shard_s3.py.
The short invocations run once, one after another in one interpreter (``cli_batch``), each in its own
directory; the killed one is a process of its own."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from agoractl.data.shard import verify_shard
from agoractl.data.index import read_index
from tests.conftest import MANIFESTS, cli_batch
from tests.data.corpus import bulk_corpus, read_ids, sample_corpus

M = str(MANIFESTS / "local-cpu.yaml")


def shard_args(source, output, *extra):
    return ["shard", M, "--set", f"data.source={source}", "--set", f"data.output={output}", *extra]


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and all(f in lines[0] for f in fragments), proc.stderr
    assert len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("hint: ")), proc.stderr
    assert proc.stdout == ""


UNREACHABLE_S3 = {"AGORA_S3_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                  "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}
HUB = "hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet"
EXECUTOR_ERRORS = [
    (["--executor", "dask"], "--executor dask needs the scheduler: --address"),
    (["--address", "tcp://127.0.0.1:8786"], "--address names a Dask scheduler: add --executor dask"),
    (["--executor", "ray"], "--executor must be one of local, dask; got 'ray'"),
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The module's short invocations, each in a directory of its own (name -> (CompletedProcess, directory)),
    one after another in one interpreter (``cli_batch``). The environment points S3 at a closed port (one
    attempt), keeps the Hugging Face hub offline and names no Dask scheduler: only the tests of S3, the hub
    and the executor reach those."""
    root = tmp_path_factory.mktemp("shard-cli")
    dirs = {}

    def at(name):
        dirs[name] = root / name
        dirs[name].mkdir()
        return dirs[name]

    sample_corpus(at("json") / "src", rows=900, files=2)
    at("defaults")
    at("empty-glob")
    for damage in ("not-parquet", "truncated"):
        bad = sample_corpus(at(damage) / "src", rows=600, files=2) / "001_00000.parquet"
        if damage == "not-parquet":
            bad.write_text("id,text\n1,hello\n")
        else:
            bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    sample_corpus(at("text-column") / "src", rows=300, files=1)
    at("store"), at("hub")
    for i, _ in enumerate(EXECUTOR_ERRORS):
        at(f"executor{i}")
    sample_corpus(at("plan") / "src", rows=900, files=3)
    runs = {
        "json": shard_args("src/*.parquet", "out", "--set", "data.num_shards=3", "--json", "--jobs", "2"),
        "defaults": ["data", "sample", "--out", "runs/local-cpu/sample"],
        "defaults-json": ["shard", M, "--json"],
        "defaults-human": ["shard", M],
        "empty-glob": shard_args("nowhere/*.parquet", "out"),
        "not-parquet": shard_args("src/*.parquet", "out"),
        "truncated": shard_args("src/*.parquet", "out"),
        "text-column": shard_args("src/*.parquet", "out", "--set", "data.text_column=body"),
        "store": shard_args("s3://corpus/fineweb/*.parquet", "out"),
        "hub": shard_args(HUB, "out"),
        **{f"executor{i}": shard_args("src/*.parquet", "out", *args) for i, (args, _) in enumerate(EXECUTOR_ERRORS)},
        "plan": shard_args("src/*.parquet", "out", "--set", "data.num_shards=3", "--plan", "--json"),
        "plan-human": shard_args("src/*.parquet", "out", "--plan"),
    }
    home = {"defaults-json": "defaults", "defaults-human": "defaults", "plan-human": "plan"}
    where = {name: dirs[home.get(name, name)] for name in runs}
    procs = cli_batch([(args, where[name]) for name, args in runs.items()], cwd=root,
                      env={**UNREACHABLE_S3, "HF_HUB_OFFLINE": "1", "DASK_SCHEDULER_ADDRESS": ""})
    return {name: (proc, where[name]) for name, proc in zip(runs, procs)}


def exits(proc, code: int):
    assert proc.returncode == code, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_json_report(shards):
    proc, tmp_path = shards["json"]
    data = json.loads(exits(proc, 0).stdout)
    assert {"shards", "rows", "tokens", "dropped", "index"} <= set(data)
    assert data["shards"] == 3 and data["rows"] == 900 and data["dropped"] == 0
    assert data["index"] == "out/index.json" and (tmp_path / "out" / "index.json").is_file()
    assert data["tokens"] == read_index(str(tmp_path / "out")).tokens


def test_default_manifest_paths_after_data_sample(shards):
    """The demo's two steps: the sample lands where local-cpu's data.source looks."""
    exits(shards["defaults"][0], 0)
    out = json.loads(exits(shards["defaults-json"][0], 0).stdout)
    assert out["shards"] == 8 and out["rows"] == 8000
    human = exits(shards["defaults-human"][0], 0).stdout
    assert "8 (0 written, 8 kept)" in human


def test_empty_glob(shards):
    proc, _ = shards["empty-glob"]
    assert_one_line_error(proc, "nowhere/*.parquet", "no parquet files match")
    assert "agoractl data sample" in proc.stderr


@pytest.mark.parametrize("damage", ["not-parquet", "truncated"])
def test_bad_file_is_named(shards, damage):
    proc, tmp_path = shards[damage]
    bad = tmp_path / "src" / "001_00000.parquet"
    assert_one_line_error(proc, str(bad), "not a parquet file, or truncated")
    assert not (tmp_path / "out" / "index.json").exists()


def test_missing_text_column(shards):
    proc, _ = shards["text-column"]
    assert_one_line_error(proc, "000_00000.parquet", "no column 'body'")
    assert "data.text_column" in proc.stderr


def test_a_failed_rerun_leaves_no_index_claiming_old_shards(cli, tmp_path):
    src = sample_corpus(tmp_path / "src", rows=600, files=2)
    cli(*shard_args("src/*.parquet", "out", "--set", "data.num_shards=2"), check=0)
    (src / "000_00000.parquet").write_bytes(b"PAR1 broken")
    proc = cli(*shard_args("src/*.parquet", "out", "--set", "data.num_shards=2"))
    assert proc.returncode == 1
    # The old index still describes the old shards exactly (nothing was touched)...
    idx = read_index(str(tmp_path / "out"))
    assert all(verify_shard(str(tmp_path / "out"), e) for e in idx.shards)


def test_unreachable_store(shards):
    proc, _ = shards["store"]
    assert_one_line_error(proc, "s3://corpus/fineweb/*.parquet", "cannot reach the store")


def test_unreachable_hub(shards):
    """hf:// goes through the Hugging Face filesystem; offline, the URL is named in one line."""
    proc, _ = shards["hub"]
    assert_one_line_error(proc, HUB)
    assert "huggingface.co" in proc.stderr


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory):
    return bulk_corpus(tmp_path_factory.mktemp("big") / "src", rows=60000, files=6)


@pytest.fixture(scope="module")
def clean_big(big_corpus, tmp_path_factory):
    """An uninterrupted `shard` of the big corpus (48 shards, 2 jobs): the reference for the reruns."""
    cwd = tmp_path_factory.mktemp("clean")
    proc = subprocess.run([sys.executable, "-m", "agoractl", *shard_args(f"{big_corpus}/*.parquet", "clean", "--set",
                                                                          "data.num_shards=48", "--jobs", "2")],
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return cwd / "clean"


def _kill_when(proc, ready, timeout=120):
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "shard finished before it could be killed; make the corpus bigger"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the command and its worker processes, mid-flight
    proc.wait(30)


@pytest.mark.parametrize("phase", ["deal", "write"])
def test_sigkill_then_rerun_completes_consistently(cli, tmp_path, big_corpus, clean_big, phase):
    args = shard_args(f"{big_corpus}/*.parquet", "out", "--set", "data.num_shards=48", "--jobs", "2")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "agoractl", *args], cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if phase == "deal":
            _kill_when(proc, lambda: any((out / ".work" / "units").glob("unit-*.json")))
        else:
            _kill_when(proc, lambda: any((out / ".done").glob("shard-*.json")))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert not (out / "index.json").exists()
    kept = len(list((out / ".done").glob("*.json"))) if (out / ".done").exists() else 0
    result = json.loads(cli(*args, "--json", check=0).stdout)
    assert result["written"] == 48 - kept
    idx = read_index(str(out))
    assert len(idx.shards) == 48 and all(verify_shard(str(out), e) for e in idx.shards)
    ids = read_ids(out)
    expected = [i for f in sorted(big_corpus.glob("*.parquet")) for i in pq.read_table(f, columns=["id"]).column(0).to_pylist()]
    assert collections.Counter(ids) == collections.Counter(expected) and len(set(ids)) == len(ids)
    # ...and the result is byte-identical to an uninterrupted run.
    clean = clean_big
    for e in idx.shards:
        assert (out / e.name).read_bytes() == (clean / e.name).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in clean.iterdir())


@pytest.mark.parametrize("i, args, fragment", [(i, a, f) for i, (a, f) in enumerate(EXECUTOR_ERRORS)])
def test_executor_usage_errors(shards, i, args, fragment):
    proc, tmp_path = shards[f"executor{i}"]
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {fragment}"), proc.stderr
    assert proc.stdout == "" and not (tmp_path / "out").exists()


def test_plan_writes_nothing(shards):
    proc, tmp_path = shards["plan"]
    plan = json.loads(exits(proc, 0).stdout)
    assert plan["files"] == 3 and plan["rows"] == 900 and plan["shards"] == 3 and plan["units"] == 3
    assert plan["rows_per_shard"] == 300 and plan["spill_bytes"] > plan["uncompressed_bytes"] > plan["input_bytes"]
    assert plan["estimated_tokens"] > 900 and plan["estimated_seconds"] > 0
    assert plan["memory_per_worker_bytes"] > max(plan["memory"]["deal"], plan["memory"]["write"])
    human = exits(shards["plan-human"][0], 0).stdout
    assert "memory per worker" in human and "spill" in human
    assert not (tmp_path / "out").exists()
