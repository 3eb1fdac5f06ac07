"""``agoractl shard FILE --plan``: what re-sharding will read, write and need, without writing anything.

From the input's parquet footers (and one row group read to measure tokens per byte of text under
the manifest's tokenizer): files, bytes, rows, estimated tokens, shards and their expected size,
the spill space the deal pass needs, the units and tasks, the memory one worker needs, and a time
estimated at the measured local rate.

The memory bound per worker follows from the two passes: a deal task holds one unit (its row groups
as read, the gathered copy grouped by shard, one shard's IPC stream); a write task holds one shard
(its pieces, the sorted copy, the parquet encoder's pages). Neither depends on the corpus size, only
on the unit size and on the shard size (``input / data.num_shards``). The factors below were measured
by ``benchmarks/shard_cluster.py`` (peak anonymous RSS of the cluster's workers minus their idle RSS).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from agoractl.data.shard import UNIT_BYTES, plan_units
from agoractl.data.sources import inspect_all, list_files, read_groups
from agoractl.data.tokenizers import load_tokenizer
from agoractl.manifest.schema import Run

LOCAL_MB_PER_S_PER_CORE = 10.0
"""Parquet MB re-sharded per second per core by the local executor (issue 23: 64 MB to 1,000 shards in
7.6 s and 254 MB in 12.7 s on a 2-core machine, about 20 MB/s)."""
WORKER_BASE_BYTES = 200 << 20
"""A worker process's own footprint (Python, Arrow and its thread pool, the tokenizer, what the allocator
keeps between tasks): 125-145 MB of anonymous RSS between tasks, measured on Dask workers."""
DEAL_FACTOR = 3.0
"""Peak bytes of a deal task per uncompressed byte of its unit (read, gathered copy, one stream)."""
WRITE_FACTOR = 3.0
"""Peak bytes of a write task per uncompressed byte of its shard (pieces, sorted copy, encoder)."""


def memory_bound(unit_bytes: int, shard_bytes: int, threads: int = 1) -> int:
    """Bytes one worker process needs at most, running `threads` tasks at a time."""
    return WORKER_BASE_BYTES + threads * int(max(DEAL_FACTOR * unit_bytes, WRITE_FACTOR * shard_bytes))


def plan(run: Run, unit_bytes: int = UNIT_BYTES, workers: int = 1) -> dict[str, Any]:
    d = run.data
    files = inspect_all(list_files(d.source), d.text_column, d.id_column, need_int_score=d.min_int_score is not None)
    units = plan_units(files, unit_bytes)
    input_bytes = sum(f.size for f in files)
    raw_bytes = sum(sum(f.group_bytes) for f in files)
    rows = sum(f.rows for f in files)
    tokens_per_row = _tokens_per_row(run, files)
    unit_max = max((sum(f.group_bytes[u.first_group:u.stop_group]) for f in files for u in units if u.url == f.url),
                   default=0)
    shard_raw = raw_bytes / d.num_shards + 8 * rows / d.num_shards  # plus the 8-byte sort key per row
    seconds = input_bytes / 1e6 / (LOCAL_MB_PER_S_PER_CORE * max(1, workers))
    return {
        "source": d.source, "output": d.output, "files": len(files), "input_bytes": input_bytes,
        "uncompressed_bytes": raw_bytes, "rows": rows, "estimated_tokens": int(tokens_per_row * rows),
        "shards": d.num_shards, "rows_per_shard": rows / d.num_shards,
        "bytes_per_shard": input_bytes / d.num_shards, "spill_bytes": int(raw_bytes + 8 * rows),
        "units": len(units), "unit_bytes_max": unit_max,
        "spill_reads": len(units) * d.num_shards,  # at most: pieces of every unit for every shard
        "memory_per_worker_bytes": memory_bound(unit_max, int(shard_raw)),
        "memory": {"base": WORKER_BASE_BYTES, "deal": int(DEAL_FACTOR * unit_max),
                   "write": int(WRITE_FACTOR * shard_raw)},
        "workers": workers, "estimated_seconds": seconds,
        "rate_mb_per_s": LOCAL_MB_PER_S_PER_CORE * max(1, workers),
    }


def _tokens_per_row(run: Run, files) -> float:
    """Tokens per document (one EOS each), measured on the first row group of the first file."""
    f = files[0]
    if not f.row_groups or f.row_groups[0] == 0:
        return 0.0
    text: pa.ChunkedArray = read_groups(f.url, range(0, 1), [run.data.text_column]).column(0)
    lengths = load_tokenizer(run).lengths_arrow(text)
    return float(lengths.sum() + len(text)) / len(text)
