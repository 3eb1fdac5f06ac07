"""`agoractl shard` as a real subprocess: JSON output, bad input (one line, exit 1, no index), and a
SIGKILL part-way through followed by a rerun. Local files in tmp_path; S3 is in tests/data/test_shard_s3.py."""

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
from tests.conftest import MANIFESTS
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


def test_json_report(cli, tmp_path):
    sample_corpus(tmp_path / "src", rows=900, files=2)
    proc = cli(*shard_args("src/*.parquet", "out", "--set", "data.num_shards=3", "--json", "--jobs", "2"), check=0)
    data = json.loads(proc.stdout)
    assert {"shards", "rows", "tokens", "dropped", "index"} <= set(data)
    assert data["shards"] == 3 and data["rows"] == 900 and data["dropped"] == 0
    assert data["index"] == "out/index.json" and (tmp_path / "out" / "index.json").is_file()
    assert data["tokens"] == read_index(str(tmp_path / "out")).tokens


def test_default_manifest_paths_after_data_sample(cli, tmp_path):
    """The demo's two steps: the sample lands where local-cpu's data.source looks."""
    cli("data", "sample", "--out", "runs/local-cpu/sample", check=0)
    out = json.loads(cli("shard", M, "--json", check=0).stdout)
    assert out["shards"] == 8 and out["rows"] == 8000
    human = cli("shard", M, check=0).stdout
    assert "8 (0 written, 8 kept)" in human


def test_empty_glob(cli, tmp_path):
    proc = cli(*shard_args("nowhere/*.parquet", "out"))
    assert_one_line_error(proc, "nowhere/*.parquet", "no parquet files match")
    assert "agoractl data sample" in proc.stderr


@pytest.mark.parametrize("damage", ["not-parquet", "truncated"])
def test_bad_file_is_named(cli, tmp_path, damage):
    src = sample_corpus(tmp_path / "src", rows=600, files=2)
    bad = src / "001_00000.parquet"
    if damage == "not-parquet":
        bad.write_text("id,text\n1,hello\n")
    else:
        bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    proc = cli(*shard_args("src/*.parquet", "out"))
    assert_one_line_error(proc, str(bad), "not a parquet file, or truncated")
    assert not (tmp_path / "out" / "index.json").exists()


def test_missing_text_column(cli, tmp_path):
    sample_corpus(tmp_path / "src", rows=300, files=1)
    proc = cli(*shard_args("src/*.parquet", "out", "--set", "data.text_column=body"))
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


def test_unreachable_store(cli, tmp_path):
    env = {"AGORA_S3_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}
    proc = cli(*shard_args("s3://corpus/fineweb/*.parquet", "out"), env=env)
    assert_one_line_error(proc, "s3://corpus/fineweb/*.parquet", "cannot reach the store")


def test_unreachable_hub(cli, tmp_path):
    """hf:// goes through the Hugging Face filesystem; offline, the URL is named in one line."""
    source = "hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet"
    proc = cli(*shard_args(source, "out"), env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(proc, source)
    assert "huggingface.co" in proc.stderr


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory):
    return bulk_corpus(tmp_path_factory.mktemp("big") / "src", rows=60000, files=6)


def _kill_when(proc, ready, timeout=120):
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "shard finished before it could be killed; make the corpus bigger"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the command and its worker processes, mid-flight
    proc.wait(30)


@pytest.mark.parametrize("phase", ["deal", "write"])
def test_sigkill_then_rerun_completes_consistently(cli, tmp_path, big_corpus, phase):
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
    clean = tmp_path / "clean"
    cli(*shard_args(f"{big_corpus}/*.parquet", "clean", "--set", "data.num_shards=48", "--jobs", "2"), check=0)
    for e in idx.shards:
        assert (out / e.name).read_bytes() == (clean / e.name).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in clean.iterdir())


@pytest.mark.parametrize("args, fragment", [
    (["--executor", "dask"], "--executor dask needs the scheduler: --address"),
    (["--address", "tcp://127.0.0.1:8786"], "--address names a Dask scheduler: add --executor dask"),
    (["--executor", "ray"], "--executor must be one of local, dask; got 'ray'"),
])
def test_executor_usage_errors(cli, tmp_path, args, fragment):
    proc = cli(*shard_args("src/*.parquet", "out", *args), env={"DASK_SCHEDULER_ADDRESS": ""})
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {fragment}"), proc.stderr
    assert proc.stdout == "" and not (tmp_path / "out").exists()


def test_plan_writes_nothing(cli, tmp_path):
    sample_corpus(tmp_path / "src", rows=900, files=3)
    plan = json.loads(cli(*shard_args("src/*.parquet", "out", "--set", "data.num_shards=3", "--plan", "--json"),
                          check=0).stdout)
    assert plan["files"] == 3 and plan["rows"] == 900 and plan["shards"] == 3 and plan["units"] == 3
    assert plan["rows_per_shard"] == 300 and plan["spill_bytes"] > plan["uncompressed_bytes"] > plan["input_bytes"]
    assert plan["estimated_tokens"] > 900 and plan["estimated_seconds"] > 0
    assert plan["memory_per_worker_bytes"] > max(plan["memory"]["deal"], plan["memory"]["write"])
    human = cli(*shard_args("src/*.parquet", "out", "--plan"), check=0).stdout
    assert "memory per worker" in human and "spill" in human
    assert not (tmp_path / "out").exists()
