"""`agoractl rotate-shards` as a real subprocess on real shards: two exhausted trainers are rotated,
the others left alone, a second run changes nothing; the corpus running out; --wrap. Files in tmp_path."""

from __future__ import annotations

import json

from agoractl.data.ledger import Holding, read_ledger, write_progress
from tests.conftest import MANIFESTS
from tests.data.corpus import sample_corpus

SETS = ["--set", "data.source=src/*.parquet", "--set", "data.output=out", "--set", "data.num_shards=20",
        "--set", "trainers.count=4", "--set", "trainers.shards_per_trainer=3"]


def rotate(cli, *extra):
    return cli("rotate-shards", str(MANIFESTS / "local-cpu.yaml"), *SETS, *extra, check=0)


def report_exhausted(out, trainer, consumed_fraction=1.0):
    holdings = read_ledger(str(out)).trainer(trainer).holdings
    write_progress(str(out), trainer, [Holding(h.shard, h.epoch, h.tokens, int(h.tokens * consumed_fraction))
                                       for h in holdings])


def test_rotate_two_exhausted_trainers(cli, tmp_path):
    sample_corpus(tmp_path / "src", rows=1000, files=2)
    cli("shard", str(MANIFESTS / "local-cpu.yaml"), *SETS, check=0)
    first = json.loads(rotate(cli, "--json").stdout)  # creates the ledger: nothing exhausted yet
    assert first["rotated"] == [] and [t["shards"] for t in first["trainers"]] == \
        [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    out = tmp_path / "out"
    report_exhausted(out, 1)
    report_exhausted(out, 3)
    report_exhausted(out, 2, consumed_fraction=0.5)  # half-way: left alone
    before = (out / "ledger.json").read_bytes()
    dry = json.loads(rotate(cli, "--json", "--dry-run").stdout)
    assert dry["changed"] and not dry["written"] and (out / "ledger.json").read_bytes() == before
    done = json.loads(rotate(cli, "--json").stdout)
    assert done["rotated"] == [{"trainer": 1, "from": [3, 4, 5], "to": [12, 13, 14]},
                               {"trainer": 3, "from": [9, 10, 11], "to": [15, 16, 17]}]
    assert dry["rotated"] == done["rotated"]
    shards = {t["trainer"]: t["shards"] for t in done["trainers"]}
    assert shards[0] == [0, 1, 2] and shards[2] == [6, 7, 8]
    assert [t["consumed"][0] > 0 for t in done["trainers"]] == [False, False, True, False]
    after = (out / "ledger.json").read_bytes()
    second = json.loads(rotate(cli, "--json").stdout)
    assert second["changed"] is False and second["rotated"] == [] and (out / "ledger.json").read_bytes() == after
    human = rotate(cli).stdout
    assert "unchanged" in human and "12 13 14" in human


def test_corpus_used_up_then_wrap(cli, tmp_path):
    sample_corpus(tmp_path / "src", rows=600, files=1)
    sets = ["--set", "data.num_shards=13"]
    cli("shard", str(MANIFESTS / "local-cpu.yaml"), *SETS, *sets, check=0)
    rotate(cli, *sets)
    out = tmp_path / "out"
    for t in range(4):
        report_exhausted(out, t)
    proc = rotate(cli, *sets, "--json")
    data = json.loads(proc.stdout)
    assert data["rotated"][0] == {"trainer": 0, "from": [0, 1, 2], "to": [12]}
    assert data["corpus_used_up"] and data["starved"] == [1, 2, 3]
    assert "corpus used up" in proc.stderr and "--wrap" in proc.stderr
    wrapped = json.loads(rotate(cli, *sets, "--json", "--wrap").stdout)
    assert wrapped["epoch"] == 1 and [r["trainer"] for r in wrapped["rotated"]] == [1, 2, 3]
    assert all(len(r["to"]) == 3 for r in wrapped["rotated"])


def test_missing_index(cli, tmp_path):
    proc = cli("rotate-shards", str(MANIFESTS / "local-cpu.yaml"), "--set", "data.output=nowhere")
    assert proc.returncode == 1 and proc.stderr.startswith("error: no shard index at nowhere/index.json")
