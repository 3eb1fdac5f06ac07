"""Re-sharding (agoractl.data.shard) on real parquet files: conservation, determinism, balance, token
counts, filters, resumability. Hermetic: local files in tmp_path (S3 is in test_shard_s3.py)."""

from __future__ import annotations

import collections
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from agoractl.data.index import read_index
from agoractl.data.shard import reshard
from agoractl.data.tokenizers import BytesTokenizer
from tests.data.corpus import bulk_corpus, load_run, read_ids, sample_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return sample_corpus(tmp_path_factory.mktemp("corpus"), rows=3000, files=3)


def input_ids(directory) -> list[str]:
    return [i for f in sorted(directory.glob("*.parquet")) for i in pq.read_table(f).column("id").to_pylist()]


def test_conservation_balance_and_index(tmp_path, corpus):
    run = load_run(tmp_path, f"{corpus}/*.parquet", str(tmp_path / "out"), data__num_shards=7)
    result = reshard(run, jobs=1)
    out = tmp_path / "out"
    # Every document in exactly one shard.
    assert collections.Counter(read_ids(out)) == collections.Counter(input_ids(corpus))
    idx = read_index(str(out))
    assert [s.name for s in idx.shards] == [f"shard-{k:05d}.parquet" for k in range(7)]
    rows = [pq.ParquetFile(out / s.name).metadata.num_rows for s in idx.shards]
    assert rows == [s.rows for s in idx.shards] and sum(rows) == 3000 == idx.rows
    assert max(rows) - min(rows) <= 1  # dealt by a permutation: sizes differ by at most one row
    # Each shard mixes all sources, in shuffled order.
    for s in idx.shards:
        urls = pq.read_table(out / s.name, columns=["url"]).column("url").to_pylist()
        assert {u.split("/")[-1][:3] for u in urls} == {"000", "001", "002"}
    # Token counts: bytes tokenizer, one EOS per document; sha256 and size recorded.
    tok = BytesTokenizer()
    for s in idx.shards:
        texts = pq.read_table(out / s.name, columns=["text"]).column("text").to_pylist()
        assert s.tokens == sum(len(tok.encode(t)) + 1 for t in texts)
        assert s.bytes == os.path.getsize(out / s.name)
    assert idx.tokens == sum(s.tokens for s in idx.shards)
    assert idx.tokenizer["kind"] == "bytes" and idx.seed == 0 and len(idx.sources) == 3
    assert result.written == 7
    # The shard schema is FineWeb-Edu's; no spill or marker left behind.
    assert pq.read_schema(out / idx.shards[0].name).names[:2] == ["text", "id"]
    assert sorted(p.name for p in out.iterdir()) == ["index.json"] + [s.name for s in idx.shards]


def test_same_seed_byte_identical_other_seed_other_order(tmp_path, corpus):
    def shard_bytes(name, seed, jobs):
        run = load_run(tmp_path, f"{corpus}/*.parquet", str(tmp_path / name), data__num_shards=4,
                       data__seed=seed)
        reshard(run, jobs=jobs, unit_bytes=1)  # one row group per unit: several units per file
        return [(tmp_path / name / f"shard-{k:05d}.parquet").read_bytes() for k in range(4)]

    a, b, c = shard_bytes("a", 0, 1), shard_bytes("b", 0, 2), shard_bytes("c", 1, 1)
    assert a == b  # the same seed: byte-identical, whatever the parallelism
    ids_a, ids_c = read_ids(tmp_path / "a"), read_ids(tmp_path / "c")
    assert sorted(ids_a) == sorted(ids_c) and ids_a != ids_c


def test_rerun_keeps_complete_shards_and_rebuilds_a_damaged_one(tmp_path, corpus):
    out = tmp_path / "out"
    run = load_run(tmp_path, f"{corpus}/*.parquet", str(out), data__num_shards=5)
    first = reshard(run, jobs=1)
    good = (out / "shard-00002.parquet").read_bytes()
    assert reshard(run, jobs=1).written == 0  # complete and verified: nothing to do
    (out / "shard-00002.parquet").write_bytes(good[:-100])  # damage one shard
    again = reshard(run, jobs=1)
    assert again.written == 1 and (out / "shard-00002.parquet").read_bytes() == good
    assert again.index.shards == first.index.shards


def test_new_configuration_replaces_shards_and_stale_ones_go(tmp_path, corpus):
    out = tmp_path / "out"
    reshard(load_run(tmp_path, f"{corpus}/*.parquet", str(out), data__num_shards=6), jobs=1)
    result = reshard(load_run(tmp_path, f"{corpus}/*.parquet", str(out), data__num_shards=3), jobs=1)
    assert result.written == 3 and len(read_index(str(out)).shards) == 3
    assert sorted(p.name for p in out.glob("shard-*")) == [f"shard-{k:05d}.parquet" for k in range(3)]


def test_filters_drop_and_count(tmp_path):
    src = bulk_corpus(tmp_path / "src", rows=2000, files=2)
    # Blank out some texts: empty and whitespace-only documents are dropped and counted.
    f = src / "000_00000.parquet"
    t = pq.read_table(f)
    texts = t.column("text").to_pylist()
    for i in range(0, 50):
        texts[i] = "" if i % 2 else "  \n "
    import pyarrow as pa

    pq.write_table(t.set_column(0, "text", pa.array(texts)), f, row_group_size=1000)
    run = load_run(tmp_path, f"{src}/*.parquet", str(tmp_path / "out"), data__num_shards=4)
    idx = reshard(run, jobs=1).index
    assert idx.dropped == {"empty": 50, "min_int_score": 0} and idx.rows == 1950
    run = load_run(tmp_path, f"{src}/*.parquet", str(tmp_path / "out4"), data__num_shards=4,
                   data__min_int_score=4)
    idx = reshard(run, jobs=1).index
    # int_score is 3 for half the rows, 4 for the other half (of which 25 blanks are scored 3... or 4).
    scores = pq.read_table(f).column("int_score").to_numpy()
    blank_low = int((scores[:50] < 4).sum())
    assert idx.dropped == {"empty": 50, "min_int_score": 1000 - blank_low}
    assert idx.rows == 2000 - 50 - (1000 - blank_low)
    kept = [s for k in range(4) for s in pq.read_table(tmp_path / "out4" / f"shard-{k:05d}.parquet",
                                                       columns=["int_score"]).column(0).to_pylist()]
    assert min(kept) >= 4


def test_hf_tokenizer_counts(tmp_path, corpus):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = pq.read_table(next(corpus.glob("*.parquet")), columns=["text"]).column(0).to_pylist()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<unk>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    run = load_run(tmp_path, f"{corpus}/*.parquet", str(tmp_path / "out"), data__num_shards=2,
                   tokenizer__kind="hf", tokenizer__path=str(tmp_path), model__vocab_size=300)
    idx = reshard(run, jobs=1).index
    assert idx.tokenizer["kind"] == "hf" and idx.tokenizer["eos_id"] == 0
    shard_texts = pq.read_table(tmp_path / "out" / idx.shards[0].name, columns=["text"]).column(0).to_pylist()
    assert idx.shards[0].tokens == sum(len(tok.encode(t, add_special_tokens=False).ids) + 1 for t in shard_texts)


def test_shuffle_is_uniform_enough(tmp_path):
    """Where a document lands is unrelated to where it was: input halves spread evenly over shards."""
    src = bulk_corpus(tmp_path / "src", rows=8000, files=2)
    run = load_run(tmp_path, f"{src}/*.parquet", str(tmp_path / "out"), data__num_shards=8)
    reshard(run, jobs=1)
    for k in range(8):
        ids = pq.read_table(tmp_path / "out" / f"shard-{k:05d}.parquet", columns=["id"]).column(0).to_pylist()
        first_file = np.array([i.startswith("doc-0-") for i in ids])
        assert abs(first_file.mean() - 0.5) < 0.08
        # and within the shard the two files interleave (no long runs from one file)
        runs = np.count_nonzero(first_file[1:] != first_file[:-1])
        assert runs > len(ids) / 4
    assert json.loads((tmp_path / "out" / "index.json").read_text())["format"] == "agoractl-shards/v1"
