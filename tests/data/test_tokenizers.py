"""Tokenizers named by the manifest (agoractl.data.tokenizers): the byte tokenizer and a local
`tokenizers` JSON file trained here (never downloaded). In-memory, plus files in tmp_path."""

from __future__ import annotations

import pyarrow as pa
import pytest

from agoractl.data.tokenizers import BytesTokenizer, load_tokenizer
from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.schema import BYTES_TOKENIZER_VOCAB, Run


def test_bytes_tokenizer_round_trip_and_fast_paths():
    tok = load_tokenizer(Run())
    assert isinstance(tok, BytesTokenizer) and tok.vocab_size == BYTES_TOKENIZER_VOCAB == 257 and tok.eos_id == 256
    text = "Lesson 1: Water – naïve café ☕"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text and tok.decode(ids + [tok.eos_id]) == text + "\n"
    assert tok.encode_array(text).tolist() == ids
    texts = ["", "abc", text]
    assert tok.lengths(texts).tolist() == [0, 3, len(ids)]
    assert tok.lengths_arrow(pa.chunked_array([texts + [None]])).tolist() == [0, 3, len(ids), 0]


def train(tmp_path, specials=("<|endoftext|>", "<pad>")):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["The river moves in the spring.", "Students learn that the seed grows."] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=list(specials)))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return tok, path


def test_hf_tokenizer_from_file_or_directory(tmp_path):
    ref, path = train(tmp_path)
    for where in (path, tmp_path):
        run = Run.model_validate({"tokenizer": {"kind": "hf", "path": str(where)}, "model": {"vocab_size": 512}})
        tok = load_tokenizer(run)
        assert tok.eos_id == ref.token_to_id("<|endoftext|>") and tok.vocab_size == ref.get_vocab_size()
        text = "The seed grows in the spring."
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False).ids and tok.decode(ids) == text
        assert tok.lengths([text, ""]).tolist() == [len(ids), 0]
        assert tok.describe()["kind"] == "hf" and len(tok.describe()["sha256"]) == 64
    named = Run.model_validate({"tokenizer": {"kind": "hf", "path": str(path), "eos_token": "<pad>"},
                                "model": {"vocab_size": 512}})
    assert load_tokenizer(named).eos_id == ref.token_to_id("<pad>")


def test_hf_tokenizer_errors(tmp_path):
    _, path = train(tmp_path)
    small = Run.model_validate({"tokenizer": {"kind": "hf", "path": str(path)}, "model": {"vocab_size": 10}})
    with pytest.raises(UsageError, match="model.vocab_size: 10 is smaller"):
        load_tokenizer(small)
    missing = Run.model_validate({"tokenizer": {"kind": "hf", "path": str(tmp_path / "none.json")}})
    with pytest.raises(RuntimeFailure, match="no such tokenizer file"):
        load_tokenizer(missing)
    (tmp_path / "bad.json").write_text("{}")
    bad = Run.model_validate({"tokenizer": {"kind": "hf", "path": str(tmp_path / "bad.json")}})
    with pytest.raises(RuntimeFailure, match="not a tokenizers JSON file"):
        load_tokenizer(bad)
    unknown = Run.model_validate({"tokenizer": {"kind": "hf", "path": str(path), "eos_token": "</s>"},
                                  "model": {"vocab_size": 512}})
    with pytest.raises(UsageError, match="tokenizer.eos_token"):
        load_tokenizer(unknown)
