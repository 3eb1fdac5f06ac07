"""Re-sharding on a Dask distributed cluster (agoractl.data.executors.DaskExecutor) against S3.

Real processes, no mocks: a dask.distributed LocalCluster (scheduler and nanny-supervised worker
processes on 127.0.0.1, started and stopped here) and a moto_server bucket on loopback (conftest).
Checks that shards and index are byte-identical to the local executor's with 1 and 2 workers, that
spill files live under the store's work prefix, that SIGKILLing a worker during the write pass still
ends in the same bytes (the scheduler reruns its tasks), and that after the driver itself dies
half-way, a rerun keeps the finished units and shards and ends in the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time

import boto3
import pytest

from agoractl.data.executors import DaskExecutor
from agoractl.data.shard import reshard
from tests.conftest import MANIFESTS
from tests.data.corpus import bulk_corpus, load_run

distributed = pytest.importorskip("distributed")

SHARDS = 12


class Crash(Exception):
    """The driver 'dies' (raised from its progress callback)."""


def _env(endpoint: str) -> dict[str, str]:
    return {"AGORA_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1"}


def _s3(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


@pytest.fixture(scope="module")
def world(s3_server, tmp_path_factory):
    """A bucket holding a 3-file corpus, the local executor's shards of it, and a 2-worker LocalCluster
    whose worker processes inherit the S3 environment."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in _env(s3_server).items():
            mp.setenv(k, v)
        s3 = _s3(s3_server)
        s3.create_bucket(Bucket="dask")
        src = bulk_corpus(tmp_path_factory.mktemp("dask") / "src", rows=3000, files=3)
        for f in sorted(src.glob("*.parquet")):
            s3.upload_file(str(f), "dask", f"corpus/{f.name}")
        run = load_run(src, "s3://dask/corpus/*.parquet", "s3://dask/local", data__num_shards=SHARDS)
        reshard(run, jobs=2, unit_bytes=1)  # one row group per unit: 3 units
        reference = _objects(s3, "local/")
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                           dashboard_address=None, silence_logs=40)
        try:
            yield {"s3": s3, "src": src, "reference": reference, "cluster": cluster}
        finally:
            cluster.close()


def _objects(s3, prefix: str) -> dict[str, str]:
    """Every object under `prefix`: its name and the sha256 of its bytes (a readable diff on failure)."""
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="dask", Prefix=prefix).get("Contents", [])]
    return {k[len(prefix):]: hashlib.sha256(s3.get_object(Bucket="dask", Key=k)["Body"].read()).hexdigest()
            for k in keys}


def _units(s3) -> dict[str, object]:
    return {o["Key"]: (o["LastModified"], o["ETag"]) for o in
            s3.list_objects_v2(Bucket="dask", Prefix="crashed/.work/units/").get("Contents", [])}


def _run(world, name: str):
    return load_run(world["src"], "s3://dask/corpus/*.parquet", f"s3://dask/{name}", data__num_shards=SHARDS)


def test_byte_identical_to_local_with_one_and_two_workers(world, cli, s3_server):
    """Two workers through the real command line (`--executor dask --address`), one in-process."""
    assert set(world["reference"]) == {"index.json"} | {f"shard-{k:05d}.parquet" for k in range(SHARDS)}
    cluster, s3 = world["cluster"], world["s3"]
    out = json.loads(cli("shard", MANIFESTS / "local-cpu.yaml", "--set", "data.source=s3://dask/corpus/*.parquet",
                         "--set", "data.output=s3://dask/w2", "--set", f"data.num_shards={SHARDS}", "--executor",
                         "dask", "--address", cluster.scheduler_address, "--json", env=_env(s3_server),
                         check=0).stdout)
    assert out["executor"] == "dask" and out["workers"] == 2 and out["written"] == SHARDS
    assert set(out["seconds"]) >= {"deal", "write", "total"} and out["mb_per_s"] > 0
    assert _objects(s3, "w2/") == world["reference"]  # no spill, marker or temporary left behind either

    cluster.scale(1)
    ex = DaskExecutor(cluster.scheduler_address)
    try:
        deadline = time.monotonic() + 60
        while len(ex.client.scheduler_info()["workers"]) != 1:  # scaling down retires one
            assert time.monotonic() < deadline, "the cluster did not scale down to 1 worker"
            time.sleep(0.1)
        seen = []
        result = reshard(_run(world, "w1"), executor=ex, unit_bytes=1,
                         progress=lambda phase, done, total: seen.append((phase, done, total)))
    finally:
        ex.close()
        cluster.scale(2)
    assert result.written == SHARDS and ("deal", 3, 3) in seen and ("write", SHARDS, SHARDS) in seen
    assert _objects(s3, "w1/") == world["reference"]


def test_worker_sigkilled_mid_write_then_driver_crash_and_rerun(world):
    cluster, s3 = world["cluster"], world["s3"]
    ex = DaskExecutor(cluster.scheduler_address)
    try:
        ex.client.wait_for_workers(2, timeout=240)
        pids = ex.client.run(os.getpid)
        killed = []

        def kill(phase, done, total):
            if phase == "write" and done == 1 and not killed:  # SIGKILL a worker, a busy one if any
                busy = [a for a, keys in ex.client.processing().items() if keys and a in pids]
                killed.append(pids[(busy or list(pids))[0]])
                os.kill(killed[0], signal.SIGKILL)

        # The scheduler reruns the lost worker's tasks: the job completes, same bytes.
        assert reshard(_run(world, "killed"), executor=ex, unit_bytes=1, progress=kill).written == SHARDS
        assert killed and _objects(s3, "killed/") == world["reference"]
        ex.client.wait_for_workers(2, timeout=240)  # the nanny restarted the killed worker
        assert killed[0] not in ex.client.run(os.getpid).values()

        def crash(phase, done, total):
            if phase == "write" and done == SHARDS // 2:
                raise Crash()  # the driver dies half-way through the write pass

        with pytest.raises(Crash):
            reshard(_run(world, "crashed"), executor=ex, unit_bytes=1, progress=crash)
        assert _objects(s3, "crashed/").get("index.json") is None
        units = _units(s3)
        assert len(units) == 6  # 3 spills and their markers
        kept = list(_objects(s3, "crashed/.done/"))
        after_deal = []
        again = reshard(_run(world, "crashed"), executor=ex, unit_bytes=1,
                        progress=lambda phase, done, total: after_deal.append(_units(s3)) if
                        (phase, done) == ("write", 0) else None)
    finally:
        ex.close()
    assert after_deal == [units]  # the rerun kept every finished unit (same objects, not rewritten)
    assert len(kept) >= SHARDS // 2 and again.written == SHARDS - len(kept)  # finished shards were kept
    assert _objects(s3, "crashed/") == world["reference"]
