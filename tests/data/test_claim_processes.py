"""Trainers' data paths as separate processes sharing only the shard ledger on a loopback S3 API server
(moto_server, serial: atomic conditional writes as S3): each process has its own working directory and
reads its shards from the bucket (tests/data/claim_reader.py). Checked from the processes' own logs and
the claims in the bucket: two concurrent trainers never read one shard, and together read every
sequence once; a trainer SIGKILLed mid-shard has that shard continued, after its lease expired, from
its first uncompleted sequence (only its in-flight ones are read again)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agoractl.data.claim_store import claim_store
from agoractl.data.claims import ledger_state
from agoractl.data.index import read_index
from agoractl.data.shard import reshard
from tests.conftest import ROOT
from tests.data.corpus import load_run, sample_corpus

SEQ = 512
L1 = SEQ + 1


@pytest.fixture
def bucket_corpus(serial_s3_env, tmp_path):
    """6 shards of a 200-row sample corpus, written to a fresh bucket: (--set values, env, index)."""
    out = serial_s3_env["make_bucket"](f"shards-{uuid.uuid4().hex[:8]}") + "/run"
    src = sample_corpus(tmp_path / "corpus", rows=200, files=1)
    run = load_run(tmp_path, f"{src}/*.parquet", out, data__num_shards=6, model__seq_len=SEQ)
    reshard(run, jobs=1)
    sets = [f"data.source={src}/*.parquet", f"data.output={out}", "data.num_shards=6", f"model.seq_len={SEQ}",
            "trainers.shards_per_trainer=2"]
    env = {**os.environ, **{k: v for k, v in serial_s3_env.items() if k != "make_bucket"},
           "PYTHONPATH": str(ROOT)}
    return sets, env, read_index(out), out


def start(tmp_path, name, trainer, in_flight, delay, sets, env, procs):
    work = tmp_path / name
    work.mkdir()
    argv = [sys.executable, "-m", "tests.data.claim_reader", str(work / "log"), str(trainer), str(in_flight),
            str(delay), *[a for s in sets for a in ("--set", s)]]
    p = subprocess.Popen(argv, cwd=work, env=env, stderr=open(work / "stderr", "wb"), start_new_session=True)
    procs.append(p)
    return p, work / "log"


def parse(log: Path) -> dict[str, list]:
    out: dict[str, list] = {"drawn": [], "done": [], "end": []}
    for line in log.read_text().splitlines():
        kind, *rest = line.split()
        out[kind].append(tuple(int(x) if x != "None" else None for x in rest))
    return out


def all_sequences(index) -> set[tuple[int, int, int]]:
    return {(k, 0, i * L1) for k, s in enumerate(index.shards) for i in range(s.tokens // L1)}


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


def test_two_trainers_without_a_shared_directory_claim_every_shard_once(bucket_corpus, tmp_path, procs):
    sets, env, index, out = bucket_corpus
    a, log_a = start(tmp_path, "host-a", 0, 2, 0.0, sets, env, procs)
    b, log_b = start(tmp_path, "host-b", 1, 2, 0.0, sets, env, procs)
    for p in (a, b):
        assert p.wait(300) == 0, (tmp_path / "host-a" / "stderr").read_text()[-2000:]
    ra, rb = parse(log_a), parse(log_b)
    assert ra["end"] == [(1,)] and rb["end"] == [(1,)]  # both saw the data exhausted after 1 epoch
    shards_a, shards_b = {s for s, _, _ in ra["done"]}, {s for s, _, _ in rb["done"]}
    assert shards_a and shards_b and not shards_a & shards_b  # no shard read by both
    done = ra["done"] + rb["done"]
    assert len(done) == len(set(done)) and set(done) == all_sequences(index)  # each sequence once, none skipped
    (epoch,) = ledger_state(claim_store(out), len(index.shards), 1)["epochs"]
    assert epoch["done"] == len(index.shards) and all(c["takeovers"] == 0 for c in epoch["claims"])
    assert {c["shard"] for c in epoch["claims"] if c["trainer"] == 0} == shards_a


def test_a_sigkilled_trainers_shard_is_continued_from_its_first_uncompleted_sequence(bucket_corpus, tmp_path,
                                                                                     procs):
    sets, env, index, out = bucket_corpus
    sets = [*sets, "data.lease_s=3"]
    in_flight = 3
    a, log_a = start(tmp_path, "host-a", 0, in_flight, 0.3, sets, env, procs)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not log_a.exists() or len(parse(log_a)["done"]) < 5):
        assert a.poll() is None, (tmp_path / "host-a" / "stderr").read_text()[-2000:]
        time.sleep(0.05)
    os.killpg(a.pid, signal.SIGKILL)
    a.wait(10)
    ra = parse(log_a)
    killed_shard = ra["drawn"][-1][0]
    b, log_b = start(tmp_path, "host-b", 1, 2, 0.0, sets, env, procs)
    assert b.wait(300) == 0, (tmp_path / "host-b" / "stderr").read_text()[-2000:]
    rb = parse(log_b)
    assert rb["end"] == [(1,)]
    in_flight_at_kill = set(ra["drawn"]) - set(ra["done"])
    assert 0 < len(in_flight_at_kill) <= in_flight
    again = set(rb["done"]) & set(ra["drawn"])
    assert again <= in_flight_at_kill  # only what was in flight is read again
    on_shard = sorted(o for s, _, o in rb["done"] if s == killed_shard)
    first_uncompleted = min(o for s, _, o in in_flight_at_kill if s == killed_shard)
    assert on_shard[0] == first_uncompleted  # continued exactly where its last completed sample ended
    assert set(ra["done"]) | set(rb["done"]) == all_sequences(index)
    assert len(set(ra["done"]) & set(rb["done"])) == 0
    claim = json.loads(claim_store(out).read(f"claims/epoch-00000/shard-{killed_shard:05d}.json")[0])
    assert claim["trainer"] == 1 and claim["history"][0]["trainer"] == 0 and claim["done"]
