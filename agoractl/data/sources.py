"""Input corpus files named by ``data.source``: listing through fsspec and checking each footer.

``data.source`` is a local path, directory or glob, an ``s3://`` URL or glob (s3fs, endpoint and
credentials from the environment), or an ``hf://datasets/...`` URL or glob (the Hugging Face
filesystem of ``huggingface_hub``). Every file's parquet footer is read up front, so an empty glob,
a file that is not parquet or is truncated (its footer is at the end), a missing text column, or an
unreachable store fails before anything is written, with one line naming the file or URL.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from agoractl import storage
from agoractl.data import remote
from agoractl.errors import RuntimeFailure

GLOB_CHARS = "*?["


@dataclass
class SourceFile:
    url: str
    size: int
    rows: int
    row_groups: list[int]
    """Rows per row group."""
    group_bytes: list[int]
    """Uncompressed bytes per row group (from the footer), to size units of work."""
    schema: pa.Schema


def describe_error(url: str, exc: BaseException) -> str:
    """One line naming the URL and what went wrong."""
    if url.startswith("hf://"):
        text = str(exc).splitlines()[0] if str(exc) else ""
        return f"{url}: {type(exc).__name__}: {text}"
    return storage.describe_error(url, exc)


def store_hint(url: str) -> str:
    """What to check when `url` cannot be read."""
    if url.startswith("s3://"):
        return "check AGORA_S3_ENDPOINT_URL, the AWS_* credentials and that the bucket exists"
    if url.startswith("hf://"):
        return "check the network (hf:// reads from huggingface.co) and HF_TOKEN for gated datasets"
    return "check the path and its permissions"


def _url(fs, source: str, path: str) -> str:
    if storage.is_remote(source):
        return fs.unstrip_protocol(path)
    return path


def list_files(source: str) -> list[str]:
    """The parquet files `source` names, sorted (the order fixes every document's global position)."""
    fs, path = remote.filesystem(source)
    try:
        if any(c in path for c in GLOB_CHARS):
            paths = fs.glob(path)
        elif fs.isdir(path):
            paths = [p for p in fs.find(path) if p.endswith(".parquet")]
        elif fs.exists(path):
            paths = [path]
        else:
            paths = []
        paths = [p for p in paths if not fs.isdir(p)]
    except RuntimeFailure:
        raise
    except Exception as e:
        raise RuntimeFailure(f"data.source: {describe_error(source, e)}", hint=store_hint(source))
    if not paths:
        raise RuntimeFailure(f"data.source {source}: no parquet files match",
                             hint="fix data.source (a path, directory or glob), or make a corpus with "
                                  "`agoractl data sample --out DIR`")
    return [_url(fs, source, p) for p in sorted(paths)]


def inspect(url: str, text_column: str, id_column: str, need_int_score: bool = False) -> SourceFile:
    """Read one file's footer and check its columns."""
    fs, path = remote.filesystem(url)
    try:
        size = fs.size(path)
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
    except (pa.ArrowInvalid, OSError) as e:
        if isinstance(e, pa.ArrowInvalid) or "magic" in str(e).lower() or "footer" in str(e).lower():
            raise RuntimeFailure(f"{url}: not a parquet file, or truncated ({str(e).splitlines()[0][:120]})",
                                 hint="remove it from data.source or fetch it again")
        raise RuntimeFailure(describe_error(url, e), hint=store_hint(url))
    except Exception as e:
        raise RuntimeFailure(describe_error(url, e), hint=store_hint(url))
    names = schema.names
    for column, field in ((text_column, "data.text_column"), (id_column, "data.id_column")):
        if column not in names:
            raise RuntimeFailure(f"{url}: no column {column!r} (columns: {', '.join(names)})",
                                 hint=f"set {field} to the column that holds it")
    if need_int_score and "int_score" not in names:
        raise RuntimeFailure(f"{url}: data.min_int_score is set but the file has no int_score column",
                             hint="unset data.min_int_score for a corpus without FineWeb-Edu scores")
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    return SourceFile(url, size, meta.num_rows, [g.num_rows for g in groups],
                      [g.total_byte_size for g in groups], schema)


def inspect_all(urls: list[str], text_column: str, id_column: str, need_int_score: bool = False,
                threads: int = 16) -> list[SourceFile]:
    """Footers of every file, read concurrently (remote footers are small ranged reads)."""
    with ThreadPoolExecutor(max(1, min(threads, len(urls)))) as pool:
        return list(pool.map(lambda u: inspect(u, text_column, id_column, need_int_score), urls))


def common_schema(files: list[SourceFile], text_column: str, id_column: str) -> pa.Schema:
    """The columns every shard carries: text and id, then every other column all files share, typed alike."""
    first = files[0].schema
    fields = [first.field(text_column), first.field(id_column)]
    for f in first:
        if f.name in (text_column, id_column):
            continue
        if all(f.name in s.schema.names and s.schema.field(f.name).type == f.type for s in files[1:]):
            fields.append(f)
    return pa.schema(fields)


def read_groups(url: str, groups: range, columns: list[str]) -> pa.Table:
    """Row groups `groups` of one file (one bounded unit of work)."""
    fs, path = remote.filesystem(url)
    try:
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).read_row_groups(list(groups), columns=columns)
    except Exception as e:
        raise RuntimeFailure(f"{url}: cannot read row groups {groups.start}-{groups.stop - 1} "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})",
                             hint="the file is damaged: remove it from data.source or fetch it again")


def schema_of(table: pa.Table, schema: pa.Schema) -> Optional[pa.Table]:
    """`table` restricted and cast to `schema`."""
    return table.select(schema.names).cast(schema)
