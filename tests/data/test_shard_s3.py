"""Re-sharding from and to a bucket on a real loopback S3 API server (moto_server) through s3fs, and
trainers streaming from it. No mocks: the `s3_env` fixture runs moto_server on 127.0.0.1."""

from __future__ import annotations

import collections
import json

import pyarrow.parquet as pq
import s3fs

from agoractl.data.index import read_index
from agoractl.data.stream import report_progress, trainer_stream
from tests.conftest import MANIFESTS
from tests.data.corpus import load_run, sample_corpus


def s3(env) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": env["AGORA_S3_ENDPOINT_URL"]},
                             skip_instance_cache=True)


def test_shard_from_bucket_to_bucket(cli, tmp_path, s3_env):
    src, dst = s3_env["make_bucket"]("corpus"), s3_env["make_bucket"]("shards")
    local = sample_corpus(tmp_path / "src", rows=900, files=3)
    fs = s3(s3_env)
    for f in sorted(local.glob("*.parquet")):
        fs.put_file(str(f), f"corpus/fineweb-edu/{f.name}")
    env = {k: v for k, v in s3_env.items() if k != "make_bucket"}
    args = ["shard", str(MANIFESTS / "local-cpu.yaml"), "--set", f"data.source={src}/fineweb-edu/*.parquet",
            "--set", f"data.output={dst}/run-1", "--set", "data.num_shards=4", "--json", "--jobs", "2"]
    data = json.loads(cli(*args, env=env, check=0).stdout)
    assert data["shards"] == 4 and data["rows"] == 900 and data["index"] == "s3://shards/run-1/index.json"
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("shards/run-1"))
    assert names == ["index.json"] + [f"shard-{k:05d}.parquet" for k in range(4)]  # no markers left over
    ids = []
    for k in range(4):
        with fs.open(f"shards/run-1/shard-{k:05d}.parquet", "rb") as f:
            ids += pq.read_table(f, columns=["id"]).column(0).to_pylist()
    expected = [i for f in sorted(local.glob("*.parquet")) for i in pq.read_table(f).column("id").to_pylist()]
    assert collections.Counter(ids) == collections.Counter(expected)
    # A rerun verifies what is in the bucket and writes nothing.
    assert json.loads(cli(*args, env=env, check=0).stdout)["written"] == 0

    # Trainers stream straight from the bucket; the ledger lives beside the shards.
    run = load_run(tmp_path, f"{src}/fineweb-edu/*.parquet", f"{dst}/run-1", data__num_shards=4,
                   trainers__shards_per_trainer=1)
    stream = trainer_stream(run, 0)
    seqs = list(stream)  # a lone trainer claims every shard in turn (data.epochs 1)
    idx = read_index(run.data.output)
    assert len(seqs) == sum(s.tokens // (run.model.seq_len + 1) for s in idx.shards)
    report_progress(run, 0, stream)
    fs.invalidate_cache()
    assert all(fs.exists(f"shards/run-1/claims/epoch-00000/shard-{k:05d}.json") for k in range(4))
    assert fs.exists("shards/run-1/progress/trainer-00000.json")


def test_missing_output_bucket(cli, tmp_path, s3_env):
    sample_corpus(tmp_path / "src", rows=100, files=1)
    env = {k: v for k, v in s3_env.items() if k != "make_bucket"}
    proc = cli("shard", str(MANIFESTS / "local-cpu.yaml"), "--set", "data.source=src/*.parquet",
               "--set", "data.output=s3://no-such-bucket/shards", env=env)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[0] == "error: data.output s3://no-such-bucket/shards: the bucket 'no-such-bucket' does not exist"
