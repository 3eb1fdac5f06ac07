"""Tokenizers named by the manifest's ``tokenizer`` section: the built-in byte tokenizer and local
Hugging Face ``tokenizers`` files.

``bytes``: ids 0-255 are the UTF-8 bytes of the text, 256 is end-of-document (EOS); vocabulary 257.
``hf``: a ``tokenizer.json`` (or a directory holding one) loaded with the ``tokenizers`` package;
never downloaded. Its EOS is ``tokenizer.eos_token`` or, when unset, its first special token.

Every document is encoded as ``encode(text) + [eos_id]`` by the shard counter and by the streaming
reader alike, so the token counts in the shard index are exactly what trainers will read.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Protocol, Sequence

import numpy as np

from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.schema import BYTES_TOKENIZER_VOCAB, Run

BYTES_EOS = BYTES_TOKENIZER_VOCAB - 1


class Tokenizer(Protocol):
    """What the data path needs from a tokenizer."""

    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def lengths(self, texts: Sequence[str]) -> np.ndarray:
        """Tokens of each text, EOS not included (fast path for counting)."""

    def encode_array(self, text: str) -> np.ndarray:
        """`encode(text)` as an int64 array (fast path for the streaming reader)."""

    def lengths_arrow(self, texts: Any) -> np.ndarray:
        """`lengths` of a pyarrow string array (fast path for the shard writer)."""

    def describe(self) -> dict[str, Any]:
        """JSON-able identity, recorded in the shard index."""


class BytesTokenizer:
    """UTF-8 bytes as ids 0-255, EOS = 256."""

    eos_id = BYTES_EOS
    vocab_size = BYTES_TOKENIZER_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        # EOS (and anything outside the byte range) becomes a newline so documents stay apart.
        out = bytearray()
        for i in ids:
            i = int(i)
            out.extend(bytes([i]) if 0 <= i < 256 else b"\n")
        return out.decode("utf-8", errors="replace")

    def lengths(self, texts: Sequence[str]) -> np.ndarray:
        return np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))

    def lengths_arrow(self, texts: Any) -> np.ndarray:
        import pyarrow.compute as pc

        # A UTF-8 string's byte length is its token count: no Python objects needed.
        return pc.fill_null(pc.binary_length(texts), 0).to_numpy(zero_copy_only=False).astype(np.int64)

    def describe(self) -> dict[str, Any]:
        return {"kind": "bytes", "vocab_size": self.vocab_size, "eos_id": self.eos_id}


class HFTokenizer:
    """A local ``tokenizers`` JSON file; encodes without adding special tokens (EOS is appended by us)."""

    def __init__(self, path: str, eos_token: str | None = None):
        from tokenizers import Tokenizer as _Tok

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise RuntimeFailure(f"{file}: no such tokenizer file",
                                 hint="set tokenizer.path to a local tokenizer.json or a directory holding one")
        try:
            self._tok = _Tok.from_file(file)
        except Exception as e:  # tokenizers raises plain Exception subclasses on a bad file
            raise RuntimeFailure(f"{file}: not a tokenizers JSON file ({str(e).splitlines()[0][:200]})",
                                 hint="save one with tokenizers.Tokenizer.save(path)")
        self.path = file
        with open(file, "rb") as f:
            self._sha256 = hashlib.sha256(f.read()).hexdigest()
        if eos_token is None:
            specials = sorted((i, t.content) for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
            if not specials:
                raise UsageError(f"{file}: the tokenizer has no special token to use as end-of-document",
                                 hint="set tokenizer.eos_token")
            eos_token = specials[0][1]
        eos = self._tok.token_to_id(eos_token)
        if eos is None:
            raise UsageError(f"tokenizer.eos_token: {eos_token!r} is not in {file}",
                             hint="name a token of the tokenizer's vocabulary")
        self.eos_token = eos_token
        self.eos_id = int(eos)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def lengths(self, texts: Sequence[str]) -> np.ndarray:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))

    def lengths_arrow(self, texts: Any) -> np.ndarray:
        return self.lengths(texts.to_pylist())

    def describe(self) -> dict[str, Any]:
        return {"kind": "hf", "path": self.path, "sha256": self._sha256, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "eos_token": self.eos_token}


def load_tokenizer(run: Run) -> Tokenizer:
    """The tokenizer the manifest names; checks that the model's vocabulary holds all its ids."""
    t = run.tokenizer
    tok: Tokenizer = BytesTokenizer() if t.kind == "bytes" else HFTokenizer(t.path or "", t.eos_token)
    if tok.vocab_size > run.model.vocab_size:
        raise UsageError(f"model.vocab_size: {run.model.vocab_size} is smaller than the tokenizer's "
                         f"vocabulary ({tok.vocab_size})", hint=f"set model.vocab_size to at least {tok.vocab_size}")
    return tok
