"""The streaming reader (agoractl.data.stream) over real shards: packing, exact resumption, the
central reference's round-robin, live pick-up after rotation. Hermetic: local files in tmp_path."""

from __future__ import annotations

import json
import threading
import time

import pyarrow.parquet as pq
import pytest
import torch

from agoractl.data.index import read_index
from agoractl.data.ledger import read_ledger, rotate_shards, write_progress
from agoractl.data.shard import reshard
from agoractl.data.stream import TrainerStream, report_progress, run_sequences, trainer_stream
from agoractl.data.tokenizers import BytesTokenizer
from agoractl.errors import RuntimeFailure
from tests.data.corpus import load_run, sample_corpus

SEQ = 64


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("stream")
    corpus = sample_corpus(base / "corpus", rows=1200, files=2)
    run = load_run(base, f"{corpus}/*.parquet", str(base / "shards"), data__num_shards=8, model__seq_len=SEQ)
    reshard(run, jobs=1)
    return base


def fresh_run(shards, tmp_path, **sets):
    """A run over the module's shards with its own copy of the output (ledger/progress are per test)."""
    import shutil

    out = tmp_path / "shards"
    shutil.copytree(shards / "shards", out)
    return load_run(tmp_path, f"{shards}/corpus/*.parquet", str(out), model__seq_len=SEQ, **sets)


def shard_tokens(run, k) -> list[int]:
    tok = BytesTokenizer()
    texts = pq.read_table(f"{run.data.output}/shard-{k:05d}.parquet", columns=["text"]).column(0).to_pylist()
    return [t for text in texts for t in tok.encode(text) + [tok.eos_id]]


def test_sequences_are_the_shards_token_streams_cut_into_seq_len_plus_one(shards, tmp_path):
    run = fresh_run(shards, tmp_path)
    stream = trainer_stream(run, 0)
    seqs = list(stream)
    assert all(s.dtype == torch.int64 and s.shape == (SEQ + 1,) for s in seqs)
    expected = []
    for k in (0, 1, 2):  # trainer 0 holds shards 0-2 (shards_per_trainer 3), read in order
        toks = shard_tokens(run, k)
        n = len(toks) // (SEQ + 1)
        expected += [toks[i * (SEQ + 1):(i + 1) * (SEQ + 1)] for i in range(n)]
        assert stream.tokens_consumed()[k] == read_index(run.data.output).shards[k].tokens - len(toks) % (SEQ + 1)
    assert [s.tolist() for s in seqs] == expected


@pytest.mark.parametrize("cut", [0, 1, 57, "boundary", "last"])
def test_resume_from_saved_position_yields_exactly_the_rest(shards, tmp_path, cut):
    run = fresh_run(shards, tmp_path)
    full = list(trainer_stream(run, 0))
    first_shard = len(shard_tokens(run, 0)) // (SEQ + 1)
    n = {"boundary": first_shard, "last": len(full) - 1}.get(cut, cut)
    stream = trainer_stream(run, 0)
    head = [next(stream) for _ in range(n)]
    saved = json.loads(json.dumps(stream.position()))  # positions are JSON
    rest = list(TrainerStream(run, 0, position=saved))
    assert len(head) + len(rest) == len(full)
    assert all(torch.equal(a, b) for a, b in zip(head + rest, full))


def test_restart_without_position_resumes_from_the_ledger(shards, tmp_path):
    """A trainer that lost its position restarts where its last consumption report left off."""
    run = fresh_run(shards, tmp_path)
    full = list(trainer_stream(run, 0))
    stream = trainer_stream(run, 0)
    for _ in range(900):  # past shard 0 (~770 sequences), into shard 1
        next(stream)
    report_progress(run, 0, stream)
    out = rotate_shards(run.data.output, read_index(run.data.output), 2, 3, SEQ, 0)
    assert out["folded"] >= 1 and out["rotated"] == []
    rest = list(trainer_stream(run, 0))
    assert all(torch.equal(a, b) for a, b in zip(rest, full[900:])) and len(rest) == len(full) - 900


def test_run_sequences_interleaves_trainers_deterministically(shards, tmp_path):
    run = fresh_run(shards, tmp_path)
    t0, t1 = list(trainer_stream(run, 0)), list(trainer_stream(run, 1))
    central = list(run_sequences(run))
    assert all(torch.equal(central[2 * i], t0[i]) and torch.equal(central[2 * i + 1], t1[i]) for i in range(300))
    again = list(run_sequences(run))
    assert len(again) == len(central) and all(torch.equal(a, b) for a, b in zip(again, central))
    # The reference covers the whole corpus: trainers rotate onto the unassigned shards 6 and 7.
    idx = read_index(run.data.output)
    assert len(central) == sum(s.tokens // (SEQ + 1) for s in idx.shards)


def test_live_trainer_picks_up_rotation_without_restart(shards, tmp_path):
    run = fresh_run(shards, tmp_path)
    idx = read_index(run.data.output)
    stream = trainer_stream(run, 0, wait_s=60, poll_s=0.02)
    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.extend(stream), daemon=True)
    reader.start()

    def wait_for_report(shard_set):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                body = json.loads((tmp_path / "shards" / "progress" / "trainer-00000.json").read_text())
                held = {h["shard"] for h in body["holdings"]}
                if held == shard_set and all(h["tokens"] - h["consumed"] < SEQ + 1 for h in body["holdings"]):
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        raise AssertionError("the trainer never reported exhaustion")

    wait_for_report({0, 1, 2})
    first = rotate_shards(run.data.output, idx, 2, 3, SEQ, 0)
    assert first["rotated"] == [{"trainer": 0, "from": [0, 1, 2], "to": [6, 7]}]
    wait_for_report({6, 7})
    second = rotate_shards(run.data.output, idx, 2, 3, SEQ, 0)
    assert second["corpus_used_up"] and second["starved"] == [0]
    reader.join(30)
    assert not reader.is_alive()
    assert len(got) == sum(idx.shards[k].tokens // (SEQ + 1) for k in (0, 1, 2, 6, 7))
    toks = shard_tokens(run, 6)
    n0 = sum(idx.shards[k].tokens // (SEQ + 1) for k in (0, 1, 2))
    assert got[n0].tolist() == toks[:SEQ + 1]


def test_trainer_without_rotation_ends(shards, tmp_path):
    run = fresh_run(shards, tmp_path)
    stream = trainer_stream(run, 1)  # wait_s 0: ends when its shards are exhausted
    assert len(list(stream)) > 0
    assert set(stream.tokens_consumed()) == {3, 4, 5}
    report = json.loads((tmp_path / "shards" / "progress" / "trainer-00001.json").read_text())
    assert {h["shard"] for h in report["holdings"]} == {3, 4, 5}
    assert read_ledger(run.data.output).trainer(1).holdings[0].consumed == 0  # trainers never write the ledger


def test_missing_index_says_what_to_run(tmp_path):
    run = load_run(tmp_path, "x/*.parquet", str(tmp_path / "nothing"))
    with pytest.raises(RuntimeFailure) as e:
        trainer_stream(run, 0)
    assert e.value.message == f"no shard index at {tmp_path}/nothing/index.json"
    assert "agoractl data sample" in e.value.hint and "agoractl shard" in e.value.hint


def test_trainer_outside_the_ledger_is_told_to_rotate(shards, tmp_path):
    run = fresh_run(shards, tmp_path)
    with pytest.raises(RuntimeFailure, match="trainer 5 has no entry"):
        trainer_stream(run, 5)


def test_tokenizer_mismatch_is_refused(shards, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the sun rises"] * 10, trainers.BpeTrainer(vocab_size=50, special_tokens=["<eos>"]))
    tok.save(str(tmp_path / "tok.json"))
    run = fresh_run(shards, tmp_path, tokenizer__kind="hf", tokenizer__path=str(tmp_path / "tok.json"))
    with pytest.raises(RuntimeFailure, match="was made with tokenizer bytes"):
        trainer_stream(run, 0)


def test_progress_reports_are_per_trainer_files(shards, tmp_path):
    run = fresh_run(shards, tmp_path)
    stream = trainer_stream(run, 0)
    for _ in range(5):
        next(stream)
    url = report_progress(run, 0, stream)
    body = json.loads(open(url).read())
    assert body["holdings"][0] == {"shard": 0, "epoch": 0, "tokens": body["holdings"][0]["tokens"],
                                   "consumed": 5 * (SEQ + 1)}
    write_progress(run.data.output, 1, [], None)
    assert sorted(p.name for p in (tmp_path / "shards" / "progress").iterdir()) == \
        ["trainer-00000.json", "trainer-00001.json"]
