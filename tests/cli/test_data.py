"""`agoractl data sample` as a real subprocess: files, JSON report, usage errors. Files in tmp_path. Each
test's invocations share one interpreter (``cli.batch``)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq


def test_sample_json(cli, tmp_path):
    js, hu = cli.batch(["data", "sample", "--out", "corpus", "--rows", "1500", "--files", "3", "--json"],
                       ["data", "sample", "--out", "corpus", "--rows", "1500", "--files", "3"])
    assert (js.returncode, hu.returncode) == (0, 0), (js.stderr, hu.stderr)
    data = json.loads(js.stdout)
    assert data["rows"] == 1500 and [f["rows"] for f in data["files"]] == [500, 500, 500]
    assert sum(pq.ParquetFile(tmp_path / "corpus" / f"{k:03d}_00000.parquet").metadata.num_rows
               for k in range(3)) == 1500
    human = hu.stdout
    assert "1500 documents" in human


def test_sample_usage_errors(cli, tmp_path):
    (tmp_path / "f").write_text("x")
    rows, files, out = cli.batch(["data", "sample", "--out", "c", "--rows", "0"],
                                 ["data", "sample", "--out", "c", "--rows", "3", "--files", "5"],
                                 ["data", "sample", "--out", "f"])
    assert rows.returncode == 2
    proc = files
    assert proc.returncode == 2 and "--files" in proc.stderr
    assert out.returncode == 2
