"""`agoractl rotate-shards` as a real subprocess on real shards and a real claim ledger: the ledger shown,
a dead trainer's claims released (and taken over by another trainer where it stopped), a forced wrap
into another epoch. Files in tmp_path."""

from __future__ import annotations

import json

from agoractl.data.claim_store import claim_store
from agoractl.data.claims import ClaimLedger
from agoractl.data.index import read_index
from tests.conftest import MANIFESTS
from tests.data.corpus import sample_corpus

SETS = ["--set", "data.source=src/*.parquet", "--set", "data.output=out", "--set", "data.num_shards=6",
        "--set", "trainers.count=4", "--set", "trainers.shards_per_trainer=2"]


def rotate(cli, *extra):
    return cli("rotate-shards", str(MANIFESTS / "local-cpu.yaml"), *SETS, *extra, check=0)


def test_release_a_dead_trainers_shards_and_force_a_wrap(cli, tmp_path):
    sample_corpus(tmp_path / "src", rows=300, files=1)
    cli("shard", str(MANIFESTS / "local-cpu.yaml"), *SETS, check=0)
    out = str(tmp_path / "out")
    tokens = [s.tokens for s in read_index(out).shards]

    def trainer(i):
        return ClaimLedger(claim_store(out), tokens, seed=0, epochs=1, trainer=i, lease_s=3600)

    dead, live = trainer(1), trainer(2)
    held = dead.acquire(2)
    dead.update(held[0].shard, 0, 130, [], done=False)  # it read 2 sequences of 64 + 1, then died
    shown = json.loads(rotate(cli, "--json").stdout)
    (e0,) = shown["epochs"]
    assert (e0["claimed"], e0["done"], e0["unclaimed"]) == (2, 0, 4) and shown["allowed_epochs"] == 1
    assert {c["shard"] for c in e0["claims"] if c["trainer"] == 1} == {c.shard for c in held}
    human = rotate(cli, "--release", "1")  # what an operator types for a dead trainer
    assert "released shard" in human.stdout and "1 epoch(s) allowed" in human.stdout
    released = json.loads(rotate(cli, "--json").stdout)
    assert all(c["expired"] for c in released["epochs"][0]["claims"])
    taken = live.acquire(6)  # the 4 unclaimed ones first, then the released two, where trainer 1 stopped
    assert {c.shard for c in taken} == set(range(6))
    assert [c.consumed for c in taken if c.shard == held[0].shard] == [130]

    wrapped = json.loads(rotate(cli, "--wrap", "--json").stdout)
    assert wrapped["allowed_epochs"] == 2 and live.allowed_epochs() == 2


def test_missing_index(cli, tmp_path):
    proc = cli("rotate-shards", str(MANIFESTS / "local-cpu.yaml"), "--set", "data.output=nowhere")
    assert proc.returncode == 1 and proc.stderr.startswith("error: no shard index at nowhere/index.json")
