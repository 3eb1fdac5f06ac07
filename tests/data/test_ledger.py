"""Shard holdings and in-memory rotation (agoractl.data.ledger, the central reference's model): pure
functions over a real ShardIndex value. In-memory."""

from __future__ import annotations

from agoractl.data.index import ShardEntry, ShardIndex
from agoractl.data.ledger import Ledger, fold_reports, initial_ledger, rotate

SEQ = 10


def make_index(n: int, tokens: int = 1000) -> ShardIndex:
    return ShardIndex(fingerprint="f" * 64, seed=0, num_shards=n, text_column="text", id_column="id",
                      min_int_score=None, tokenizer={"kind": "bytes"}, sources=[], rows=n, tokens=n * tokens,
                      dropped={"empty": 0, "min_int_score": 0},
                      shards=[ShardEntry(f"shard-{k:05d}.parquet", 1, tokens, 1, "x") for k in range(n)])


def exhaust(ledger: Ledger, trainer: int, shards: list[int] | None = None) -> None:
    """Report a trainer as having read all but seq_len tokens (less than one sequence) of its shards."""
    t = ledger.trainer(trainer)
    fold_reports(ledger, [{"trainer": trainer, "holdings": [
        {"shard": h.shard, "epoch": h.epoch, "consumed": h.tokens - SEQ}
        for h in t.holdings if shards is None or h.shard in shards]}])


def test_initial_assignment_deals_consecutive_shards():
    ledger = initial_ledger(make_index(10), trainers=3, shards_per_trainer=3, seq_len=SEQ, seed=0)
    assert [[h.shard for h in t.holdings] for t in ledger.trainers] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert ledger.cursor == 9 and ledger.epoch == 0
    short = initial_ledger(make_index(4), trainers=3, shards_per_trainer=3, seq_len=SEQ, seed=0)
    assert [[h.shard for h in t.holdings] for t in short.trainers] == [[0, 1, 2], [3], []]


def test_exhaustion_is_fewer_than_seq_len_plus_one_tokens_left():
    ledger = initial_ledger(make_index(2, tokens=100), 1, 1, SEQ, 0)
    h = ledger.trainers[0].holdings[0]
    h.consumed = 100 - (SEQ + 1)
    assert not h.exhausted(SEQ)
    h.consumed += 1
    assert h.exhausted(SEQ)


def test_rotation_reassigns_exactly_the_exhausted_trainers_and_is_idempotent():
    index = make_index(20)
    ledger = initial_ledger(index, 4, 3, SEQ, 0)
    exhaust(ledger, 1)
    exhaust(ledger, 3)
    exhaust(ledger, 2, shards=[6, 7])  # two of three shards: not exhausted, left alone
    before = {t.trainer: [h.shard for h in t.holdings] for t in ledger.trainers}
    result = rotate(ledger, index, trainers=4)
    assert result.rotated == [{"trainer": 1, "from": [3, 4, 5], "to": [12, 13, 14]},
                              {"trainer": 3, "from": [9, 10, 11], "to": [15, 16, 17]}]
    after = {t.trainer: [h.shard for h in t.holdings] for t in ledger.trainers}
    assert after[0] == before[0] and after[2] == before[2]
    assert {(r["shard"], r["trainer"]) for r in ledger.retired} == {(3, 1), (4, 1), (5, 1), (9, 3), (10, 3), (11, 3)}
    snapshot = ledger.to_json()
    again = rotate(ledger, index, trainers=4)
    assert again.rotated == [] and ledger.to_json() == snapshot


def test_corpus_used_up_then_wrap_starts_a_new_epoch_with_a_new_order():
    index = make_index(6)
    ledger = initial_ledger(index, 2, 3, SEQ, seed=7)
    exhaust(ledger, 0)
    used_up = rotate(ledger, index, 2)
    assert used_up.corpus_used_up and used_up.starved == [0] and ledger.trainer(0).holdings == []
    snapshot = ledger.to_json()
    assert rotate(ledger, index, 2).rotated == [] and ledger.to_json() == snapshot
    wrapped = rotate(ledger, index, 2, wrap=True)
    assert wrapped.epoch == 1 and not wrapped.corpus_used_up
    held = ledger.trainer(0).holdings
    assert [h.epoch for h in held] == [1, 1, 1] and [h.shard for h in held] == ledger.order[:3]
    assert sorted(ledger.order) == list(range(6)) and ledger.order != list(range(6))


def test_new_trainers_join_as_exhausted_and_get_shards():
    index = make_index(12)
    ledger = initial_ledger(index, 2, 3, SEQ, 0)
    result = rotate(ledger, index, trainers=3)
    assert result.rotated == [{"trainer": 2, "from": [], "to": [6, 7, 8]}]


def test_fold_ignores_stale_reports_and_never_goes_back():
    index = make_index(6)
    ledger = initial_ledger(index, 2, 3, SEQ, 0)
    assert fold_reports(ledger, [{"trainer": 0, "holdings": [{"shard": 0, "epoch": 0, "consumed": 500}]}]) == 1
    stale = [{"trainer": 0, "holdings": [{"shard": 0, "epoch": 0, "consumed": 100},   # older report
                                         {"shard": 4, "epoch": 0, "consumed": 900},   # not its shard
                                         {"shard": 1, "epoch": 3, "consumed": 900}]}]  # another epoch
    assert fold_reports(ledger, stale) == 0
    assert [h.consumed for h in ledger.trainer(0).holdings] == [500, 0, 0]
    assert ledger.trainer(1).holdings[1].consumed == 0
