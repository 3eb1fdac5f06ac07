"""`agoractl data sample` as a real subprocess: files, JSON report, usage errors. Files in tmp_path."""

from __future__ import annotations

import json

import pyarrow.parquet as pq


def test_sample_json(cli, tmp_path):
    data = json.loads(cli("data", "sample", "--out", "corpus", "--rows", "1500", "--files", "3", "--json",
                          check=0).stdout)
    assert data["rows"] == 1500 and [f["rows"] for f in data["files"]] == [500, 500, 500]
    assert sum(pq.ParquetFile(tmp_path / "corpus" / f"{k:03d}_00000.parquet").metadata.num_rows
               for k in range(3)) == 1500
    human = cli("data", "sample", "--out", "corpus", "--rows", "1500", "--files", "3", check=0).stdout
    assert "1500 documents" in human


def test_sample_usage_errors(cli, tmp_path):
    assert cli("data", "sample", "--out", "c", "--rows", "0").returncode == 2
    proc = cli("data", "sample", "--out", "c", "--rows", "3", "--files", "5")
    assert proc.returncode == 2 and "--files" in proc.stderr
    (tmp_path / "f").write_text("x")
    assert cli("data", "sample", "--out", "f").returncode == 2
