"""The manifest's ``data`` section: the corpus, how ``agoractl shard`` re-shards it (and which shards it holds out
for ``agoractl eval``), and how trainers claim its shards."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class Data(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    source: str = "runs/local-cpu/sample/*.parquet"
    """Input parquet files: local path or glob, s3://bucket/prefix/*.parquet, or hf://datasets/..."""
    text_column: str = "text"
    """Column holding the document text."""
    id_column: str = "id"
    """Column holding a unique document id."""
    num_shards: int = Field(8, gt=0)
    """Shards to write (the reference run: 10,080)."""
    heldout_shards: int = Field(0, ge=0)
    """Held-out shards: the last this many of the num_shards, which `agoractl shard` records as held out in
    index.json; trainers never claim them and `agoractl eval` scores checkpoints on them. 0 = none."""
    seed: int = 0
    """Shuffle seed of re-sharding."""
    output: str = "runs/local-cpu/shards"
    """Where shards, index.json and the shard ledger (claims/) go (local path or s3://)."""
    min_int_score: Optional[int] = Field(None, ge=0)
    """Drop documents whose int_score is below this; null = keep all."""
    epochs: int = Field(1, gt=0)
    """Passes over the corpus. Trainers claim shards from the shard ledger (``<output>/claims/``) until
    every shard of the epoch is read, then start the next epoch (a new shard order drawn from ``seed``)
    while fewer than this many are done; after the last one the run ends early ("data exhausted")."""
    lease_s: float = Field(60.0, gt=0)
    """Seconds a trainer's shard claim stays valid without a renewal (trainers renew every lease_s / 3 and
    after every completed sample); a dead trainer's shards go back to the pool this long after it died,
    and the next trainer continues them from its last completed sample. Trainers' clocks must agree to
    well within this."""

