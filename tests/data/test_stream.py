"""The streaming reader (agoractl.data.stream) over real shards: packing, exact resumption, the
central reference's round-robin, shards claimed from the ledger (claims in data.output) until the
data's epochs are read. Hermetic: local files in tmp_path."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import structlog
import torch

from agoractl import logs
from agoractl.data.index import read_index
from agoractl.data.ledger import write_progress
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


def fresh_run(shards, tmp_path, name="shards", **sets):
    """A run over the module's shards with its own copy of the output (ledger/progress are per test)."""
    import shutil

    out = tmp_path / name
    shutil.copytree(shards / "shards", out)
    return load_run(tmp_path, f"{shards}/corpus/*.parquet", str(out), model__seq_len=SEQ, **sets)


def shard_tokens(run, k) -> list[int]:
    tok = BytesTokenizer()
    texts = pq.read_table(f"{run.data.output}/shard-{k:05d}.parquet", columns=["text"]).column(0).to_pylist()
    return [t for text in texts for t in tok.encode(text) + [tok.eos_id]]


def cut(toks: list[int]) -> list[list[int]]:
    return [toks[i * (SEQ + 1):(i + 1) * (SEQ + 1)] for i in range(len(toks) // (SEQ + 1))]


def test_sequences_are_the_shards_token_streams_cut_into_seq_len_plus_one(shards, tmp_path):
    """A lone trainer claims shards_per_trainer (3) shards at a time until the corpus is read (data.epochs 1)."""
    run = fresh_run(shards, tmp_path)
    stream = trainer_stream(run, 0)
    seqs = list(stream)
    assert all(s.dtype == torch.int64 and s.shape == (SEQ + 1,) for s in seqs)
    assert [s.tolist() for s in seqs] == [q for k in range(8) for q in cut(shard_tokens(run, k))]
    assert stream.claims.epochs_done == 1
    assert set(stream.tokens_consumed()) == {6, 7}  # its last claims


@pytest.mark.parametrize("at", [0, 1, 57, "boundary", "last"])
def test_resume_from_saved_position_yields_exactly_the_rest(shards, tmp_path, at):
    full = list(trainer_stream(fresh_run(shards, tmp_path, "whole"), 0))
    run = fresh_run(shards, tmp_path)
    first_shard = len(shard_tokens(run, 0)) // (SEQ + 1)
    n = {"boundary": first_shard, "last": len(full) - 1}.get(at, at)
    stream = trainer_stream(run, 0)
    head = [next(stream) for _ in range(n)]
    saved = json.loads(json.dumps(stream.position()))  # positions are JSON
    rest = list(TrainerStream(run, 0, position=saved))  # takes its own claims back at once
    assert len(head) + len(rest) == len(full)
    assert all(torch.equal(a, b) for a, b in zip(head + rest, full))


def test_restart_without_position_reads_every_sequence_once(shards, tmp_path):
    """A trainer restarted without a position takes unclaimed shards, then its own claims back, from the
    consumption its last report wrote: together the two parts read the corpus once."""
    whole = [s.tolist() for s in trainer_stream(fresh_run(shards, tmp_path, "whole"), 0)]
    run = fresh_run(shards, tmp_path)
    stream = trainer_stream(run, 0)
    first = [next(stream).tolist() for _ in range(900)]  # past shard 0 (~770 sequences), into shard 1
    report_progress(run, 0, stream)
    rest = [s.tolist() for s in trainer_stream(run, 0)]
    assert sorted(first + rest) == sorted(whole)


def test_run_sequences_interleaves_trainers_deterministically(shards, tmp_path):
    """The central reference starts from the shards the swarm's trainers claim first (trainer i from
    position i * shards_per_trainer of the order)."""
    run = fresh_run(shards, tmp_path)
    s0 = trainer_stream(run, 0)
    t0 = [next(s0) for _ in range(300)]
    s1 = trainer_stream(run, 1)
    t1 = [next(s1) for _ in range(300)]
    central = list(run_sequences(run))
    assert all(torch.equal(central[2 * i], t0[i]) and torch.equal(central[2 * i + 1], t1[i]) for i in range(300))
    again = list(run_sequences(run))
    assert len(again) == len(central) and all(torch.equal(a, b) for a, b in zip(again, central))
    idx = read_index(run.data.output)
    assert len(central) == sum(s.tokens // (SEQ + 1) for s in idx.shards)


def test_epochs_read_every_shard_before_the_next_epoch_in_a_new_order(shards, tmp_path):
    """data.epochs 2, two trainers reading concurrently (threads): epoch 1 starts only after every shard of
    epoch 0, in a permuted shard order; each sequence exactly once per epoch."""
    import threading

    run = fresh_run(shards, tmp_path, data__epochs=2, data__lease_s=600)
    streams = [trainer_stream(run, 0, poll_s=0.01), trainer_stream(run, 1, poll_s=0.01)]
    read: list[tuple] = []
    lock = threading.Lock()

    def reader(st):
        for s in st:
            with lock:
                read.append((*st.last, tuple(s.tolist())))

    threads = [threading.Thread(target=reader, args=(st,)) for st in streams]
    [t.start() for t in threads]
    [t.join(600) for t in threads]
    epochs = [e for _, e, _, _ in read]
    assert epochs == sorted(epochs) and set(epochs) == {0, 1}  # nothing of epoch 1 before all of epoch 0
    whole = sorted(tuple(q) for k in range(8) for q in cut(shard_tokens(run, k)))
    for e in (0, 1):
        assert sorted(t for _, ep, _, t in read if ep == e) == whole  # every sequence once per epoch
    order1 = list(dict.fromkeys(sh for sh, ep, _, _ in read if ep == 1))
    assert sorted(order1) == list(range(8)) and order1 != list(range(8))
    assert all(st.claims.epochs_done == 2 for st in streams)
    with pytest.raises(RuntimeFailure, match="no shard left"):
        trainer_stream(run, 2)


def test_missing_index_says_what_to_run(tmp_path):
    run = load_run(tmp_path, "x/*.parquet", str(tmp_path / "nothing"))
    with pytest.raises(RuntimeFailure) as e:
        trainer_stream(run, 0)
    assert e.value.message == f"no shard index at {tmp_path}/nothing/index.json"
    assert "agoractl data sample" in e.value.hint and "agoractl shard" in e.value.hint


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
                                   "consumed": 5 * (SEQ + 1), "skip": []}
    write_progress(run.data.output, 1, [], None)
    assert sorted(p.name for p in (tmp_path / "shards" / "progress").iterdir()) == \
        ["trainer-00000.json", "trainer-00001.json"]


def test_a_trainer_waiting_for_its_first_shard_ends_the_wait_when_interrupted(shards, tmp_path):
    """Every shard is claimed by trainer 0: trainer 1 waits for one (the epoch's last shards are held by others)
    until its trainer says stop (a signal), and then reads nothing instead of failing."""
    run = fresh_run(shards, tmp_path, trainers__shards_per_trainer=8, data__lease_s=600)
    first = trainer_stream(run, 0)
    assert len(first.holdings) == 8
    asked: list[int] = []

    def interrupt() -> bool:
        asked.append(1)
        return len(asked) > 3

    logs.configure()  # before the capture (configuring replaces its processors)
    with structlog.testing.capture_logs() as logged:
        second = trainer_stream(run, 1, poll_s=0.01, interrupt=interrupt)
    assert second.holdings == [] and len(asked) >= 4  # it waited (polled) until told to stop
    assert [e["event"][:19] for e in logged] == ["waiting for a shard"] and logged[0]["trainer"] == 1  # and said so
    assert list(second) == []  # asked once more: still stopped
