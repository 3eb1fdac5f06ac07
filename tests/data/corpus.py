"""Helpers for the data tests: small corpora written as real parquet files, and manifests on them.

Hermetic: local files under the test's tmp_path; nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from agoractl.data.sample import SCHEMA, write_sample
from agoractl.manifest.loader import load_manifest
from tests.conftest import MANIFESTS


def sample_corpus(directory: Path, rows: int = 2000, files: int = 3, seed: int = 0) -> Path:
    write_sample(str(directory), rows=rows, files=files, seed=seed)
    return directory


def bulk_corpus(directory: Path, rows: int, files: int, pool: int = 500) -> Path:
    """A larger corpus fast: `pool` sample lessons reused, each row with a unique id and suffix."""
    import random

    from agoractl.data.sample import document

    rng = random.Random("bulk")
    texts = [document(rng, i)[1] for i in range(pool)]
    os.makedirs(directory, exist_ok=True)
    per = rows // files
    for k in range(files):
        n = per if k < files - 1 else rows - per * (files - 1)
        ids = [f"doc-{k}-{i}" for i in range(n)]
        cols = {name: [] for name in SCHEMA.names}
        for i in range(n):
            cols["text"].append(f"{texts[(k * per + i) % pool]} ({ids[i]})")
            cols["id"].append(ids[i])
            cols["dump"].append("CC-MAIN-2024-10")
            cols["url"].append(f"https://example.edu/{k}/{i}")
            cols["file_path"].append("s3://commoncrawl/x.warc.gz")
            cols["language"].append("en")
            cols["language_score"].append(0.95)
            cols["token_count"].append(100)
            cols["score"].append(3.0 + (i % 20) / 10)
            cols["int_score"].append(3 + (i % 20) // 10)
        pq.write_table(pa.Table.from_pydict(cols, schema=SCHEMA), directory / f"{k:03d}_00000.parquet",
                       row_group_size=1000)
    return directory


def manifest(tmp_path: Path, source: str, output: str, **sets) -> tuple[Path, list[str]]:
    """The local-cpu manifest plus --set overrides for data.source/output and anything in `sets`."""
    overrides = [f"data.source={source}", f"data.output={output}"]
    overrides += [f"{k.replace('__', '.')}={v}" for k, v in sets.items()]
    return MANIFESTS / "local-cpu.yaml", overrides


def load_run(tmp_path: Path, source: str, output: str, **sets):
    path, overrides = manifest(tmp_path, source, output, **sets)
    return load_manifest(path, overrides)


def set_args(overrides: list[str]) -> list[str]:
    out = []
    for o in overrides:
        out += ["--set", o]
    return out


def read_ids(shard_dir: Path) -> list[str]:
    out = []
    for f in sorted(shard_dir.glob("shard-*.parquet")):
        out += pq.read_table(f, columns=["id"]).column("id").to_pylist()
    return out
