"""The synthetic sample corpus (agoractl.data.sample): FineWeb-Edu's schema and layout, determinism,
learnable structure. Files in tmp_path."""

from __future__ import annotations

import collections

import pyarrow.parquet as pq

from agoractl.data.sample import SCHEMA, write_sample


def test_schema_layout_and_counts(tmp_path):
    files = write_sample(str(tmp_path), rows=2500, files=2, seed=3)
    assert [f.rows for f in files] == [1250, 1250]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000_00000.parquet", "001_00000.parquet"]
    pf = pq.ParquetFile(tmp_path / "000_00000.parquet")
    assert pf.schema_arrow.names == ["text", "id", "dump", "url", "file_path", "language", "language_score",
                                     "token_count", "score", "int_score"]
    assert pf.schema_arrow.equals(SCHEMA)
    assert [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)] == [1000, 250]
    t = pq.read_table(tmp_path / "000_00000.parquet").to_pylist()
    assert len({r["id"] for r in t}) == 1250 and all(r["id"].startswith("<urn:uuid:") for r in t)
    assert all(r["language"] == "en" and 2.5 <= r["score"] <= 5 and r["int_score"] == round(r["score"]) for r in t)
    assert all(r["text"].startswith("Lesson ") for r in t)


def test_deterministic_for_a_seed(tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        write_sample(str(tmp_path / name), rows=300, files=1, seed=seed)
    a, b, c = ((tmp_path / n / "000_00000.parquet").read_bytes() for n in "abc")
    assert a == b and a != c


def test_small_vocabulary_repeated_structure(tmp_path):
    """What makes it learnable by a tiny byte model: few distinct words, few distinct characters."""
    write_sample(str(tmp_path), rows=500, files=1)
    texts = pq.read_table(tmp_path / "000_00000.parquet").column("text").to_pylist()
    words = collections.Counter(w.strip(".,:?") for t in texts for w in t.split() if not w[0].isdigit())
    assert len(words) < 100
    assert len({ch for t in texts for ch in t}) < 60
    assert sum(len(t) for t in texts) / len(texts) > 150
