"""Corpus side of a run: tokenizers, the synthetic sample corpus, re-sharding, the shard index, the
streaming reader that trainers use, and the shard ledger with its rotation (report §3.3.2.1, §5.1)."""
