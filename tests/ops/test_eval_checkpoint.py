"""`agoractl eval FILE` on a run's checkpoint: the held-out split `agoractl shard` reserves
(``data.heldout_shards``, recorded in index.json; trainers never claim those shards), validation loss and
perplexity of the latest checkpoint on it, written to the Health Monitor's database (``health_evals``) where the
Dashboard reads it; bad input in one line. One tiny central run (3 steps) serves every check."""

from __future__ import annotations

import json
import math
import sqlite3

import pytest
from sqlalchemy.orm import Session

from agoractl.data.claim_source import ClaimSource
from agoractl.data.claims import Exhausted
from agoractl.data.index import ShardIndex, read_index
from agoractl.data.ledger import initial_ledger
from agoractl.data.tokenizers import load_tokenizer
from agoractl.manifest.loader import load_manifest
from agoractl.ops import evaluate as ev
from agoractl.ops import export as ex
from agoractl.services.dashboard.queries import latest_eval
from agoractl.services.health.db import open_database
from tests.conftest import private_shards
from tests.ops.test_export import MANIFEST, TINY, agoractl, sets


@pytest.fixture(scope="module")
def central(sample_shards, tmp_path_factory):
    """The session's 4 shards re-indexed with the last one held out (`agoractl shard`, nothing rewritten but the
    index), and a 3-step central run on them; (values, shard command's JSON)."""
    tmp = tmp_path_factory.mktemp("eval")
    values = [*private_shards(sample_shards, tmp), *TINY, f"local.run_dir={tmp / 'run'}",
              f"checkpoints.store={tmp / 'store'}", "data.heldout_shards=1"]
    shard = json.loads(agoractl("shard", str(MANIFEST), *sets(values), "--json").stdout)
    agoractl("launch", "central", str(MANIFEST), *sets(values), "--json")
    return values, shard


def test_shard_records_the_heldout_split_and_trainers_never_claim_it(central):
    values, shard = central
    run = load_manifest(MANIFEST, values)
    index = read_index(run.data.output)
    assert shard["written"] == 0 and shard["heldout"] == index.heldout == [3] and index.training == 3
    assert [h.shard for t in initial_ledger(index, 4, 1, 128, 0).trainers for h in t.holdings] == [0, 1, 2]
    source = ClaimSource(run, index, trainer=0)  # the shard ledger beside the shards (the central run has none)
    got = [c.shard for c in source.ledger.acquire(10)]
    assert sorted(got) == [0, 1, 2], got
    for c in got:
        source.ledger.update(c, 0, index.shards[c].tokens, [], done=True)
    with pytest.raises(Exhausted):
        source.ledger.acquire(10)  # the epoch ends without the held-out shard
    bad = json.loads(index.to_json())
    bad["heldout"] = [1]
    with pytest.raises(Exception, match="not the last ones"):
        ShardIndex.from_json(json.dumps(bad).encode())


def test_eval_scores_the_latest_checkpoint_and_records_it(central, tmp_path):
    """The loss is the mean NLL per token of the held-out documents: the checkpoint exported and run by
    transformers gives the same perplexity; the row in health_evals is what it printed and
    the Dashboard's query reads it."""
    values, _ = central
    got = json.loads(agoractl("eval", str(MANIFEST), *sets(values), "--from", "central", "--limit", "3",
                              "--json").stdout)
    assert got["step"] == 3 and got["shards"] == [3] and got["documents"] == 3 and got["tokens"] > 0
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"])) and 0 < got["loss"] < math.log(512)
    run = load_manifest(MANIFEST, values)
    step, state = ex.state_from_central(run)  # exported and scored by transformers, in this process
    net = ex.load_exported(ex.write_export(run, state, step, tmp_path / "hf", "central"))
    hf = ev.perplexity(lambda ids: net(ids).logits, load_tokenizer(run), ev.heldout_documents(run, [3], 3),
                       run.model.seq_len)
    assert hf["tokens"] == got["tokens"]
    assert hf["token_perplexity"] == pytest.approx(got["perplexity"], rel=1e-4), (hf, got)

    db = got["database"].removeprefix("sqlite:///")
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT run, step, loss, perplexity, tokens FROM health_evals").fetchall()
    assert rows == [(run.metadata.name, 3, got["loss"], got["perplexity"], got["tokens"])]
    engine = open_database(run)
    try:
        with Session(engine) as s:
            shown = latest_eval(s, run.metadata.name)
    finally:
        engine.dispose()
    assert (shown["step"], shown["loss"], shown["perplexity"]) == (3, got["loss"], got["perplexity"])


def test_bad_input_is_one_line(central, tmp_path):
    values, _ = central
    m = str(MANIFEST)
    cases = [  # (extra arguments, exit code, what the line names)
        (["--set", "data.heldout_shards=4"], 2, "data.heldout_shards"),
        (["--from", "central", "--write-task", str(tmp_path / "t")], 2, "--write-task needs --model"),
        (["--from", "central", "--shard", "9"], 2, "--shard 9"),
        (["--set", f"checkpoints.store={tmp_path / 'empty'}"], 1, "no checkpoint of stage head"),
    ]
    for extra, code, what in cases:
        err = agoractl("eval", m, *sets(values), *extra, check=code).stderr
        assert what in "\n".join(err.splitlines()[:2]), (extra, err)  # a manifest problem: under its header
    assert not (tmp_path / "t").exists()
    # An index without held-out shards (sharded before data.heldout_shards was set): exit 2, what to run.
    run = load_manifest(MANIFEST, values)
    index = read_index(run.data.output)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "index.json").write_bytes(ShardIndex(**{**index.__dict__, "heldout": []}).to_json())
    err = agoractl("eval", m, *sets(values), "--set", f"data.output={plain}", check=2).stderr
    assert "no held-out shards" in err.splitlines()[0] and "agoractl shard" in err, err
