"""The shard index, ``<data.output>/index.json`` (DESIGN.md §5), and shard naming.

The index is written last by ``agoractl shard``, after every shard it lists has been written and
verified, so a shard exists only once it is in the index. Per shard it records rows, tokens (under
the manifest's tokenizer, one EOS per document), bytes and sha256; for the whole corpus the seed,
the sources, the tokenizer and a fingerprint of all of them that the ledger and the resumable
writer use to tell whether files on disk belong to this configuration; and the held-out shards (the last
``data.heldout_shards``), which trainers never claim and ``agoractl eval`` scores checkpoints on.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from agoractl import storage
from agoractl.data import remote
from agoractl.errors import RuntimeFailure

FORMAT = "agoractl-shards/v1"
INDEX_NAME = "index.json"


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.parquet"


def index_url(output: str) -> str:
    return storage.join(output, INDEX_NAME)


@dataclass
class ShardEntry:
    name: str
    rows: int
    tokens: int
    bytes: int
    sha256: str


@dataclass
class ShardIndex:
    fingerprint: str
    seed: int
    num_shards: int
    text_column: str
    id_column: str
    min_int_score: Optional[int]
    tokenizer: dict[str, Any]
    sources: list[dict[str, Any]]
    rows: int
    tokens: int
    dropped: dict[str, int]
    shards: list[ShardEntry] = field(default_factory=list)
    format: str = FORMAT
    heldout: list[int] = field(default_factory=list)
    """Held-out shards (``data.heldout_shards``): always the last ones; trainers never claim them."""

    @property
    def training(self) -> int:
        """How many shards trainers claim: shards 0 .. training - 1 (every shard but the held-out ones)."""
        return len(self.shards) - len(self.heldout)

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, url: str = "index.json") -> "ShardIndex":
        try:
            raw = json.loads(data)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
            raw["shards"] = [ShardEntry(**s) for s in raw["shards"]]
            index = cls(**raw)
            n = len(index.shards)
            if index.heldout != list(range(n - len(index.heldout), n)) or len(index.heldout) >= n:
                raise ValueError(f"held-out shards {index.heldout} are not the last ones of {n}")
            return index
        except (ValueError, TypeError, KeyError) as e:
            raise RuntimeFailure(f"{url}: not a valid shard index ({e})",
                                 hint="rerun `agoractl shard FILE` to rewrite it")

    def shard_url(self, output: str, i: int) -> str:
        return storage.join(output, self.shards[i].name)


def read_index(output: str) -> ShardIndex:
    """The index under `output`; a one-line RuntimeFailure saying what to run when it is missing."""
    url = index_url(output)
    try:
        data = remote.read_bytes(url)
    except FileNotFoundError:
        raise RuntimeFailure(f"no shard index at {url}",
                             hint="run `agoractl data sample --out DIR` (or point data.source at a corpus) "
                                  "and `agoractl shard FILE` first")
    except Exception as e:  # unreachable store, bad credentials: name the URL
        raise RuntimeFailure(storage.describe_error(url, e))
    return ShardIndex.from_json(data, url)


def write_index(output: str, index: ShardIndex) -> str:
    url = index_url(output)
    remote.write_bytes(url, index.to_json())
    return url
