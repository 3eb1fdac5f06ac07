"""Re-sharding (report §5.1.0.2): ``data.source`` into ``data.num_shards`` pre-shuffled parquet shards.

Two passes with bounded memory:

1. *Deal.* The input is cut into units of a few row groups. Each unit is read, empty texts (and,
   with ``data.min_int_score``, low-scored documents) are dropped and counted, and every document g
   (its position in the concatenated input) is dealt to shard ``perm(g) % S`` with sort key
   ``perm(g) // S`` (:mod:`agoractl.data.permutation`). The unit is spilled to the work directory
   (local, or a prefix in the store) as one Arrow IPC stream per shard, then a JSON marker with each
   shard's offset and length is written (:mod:`agoractl.data.spill`).
2. *Write.* Each shard reads its piece of every unit (memory-mapped, or one ranged GET), sorts by key,
   counts tokens under the manifest's tokenizer (one EOS per document), writes parquet to a temporary
   name, checks it, renames it (or uploads it whole), and writes a ``.done/`` marker with its sha256.

Then ``index.json`` is written, last. Both passes run as tasks on an executor
(:mod:`agoractl.data.executors`: local threads, or a Dask cluster), one task per unit, then one per
shard; a task holds one unit or one shard at a time. A rerun keeps finished units and every shard
whose marker matches this configuration's fingerprint and whose file verifies (sha256 locally, size
on object stores), so a crash at any point, or a lost cluster worker, costs only the work in flight. The same seed gives byte-identical shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from agoractl import storage
from agoractl.data import remote, spill
from agoractl.data.executors import Executor, LocalExecutor, Progress
from agoractl.data.index import FORMAT, ShardEntry, ShardIndex, index_url, read_index, shard_name, write_index
from agoractl.data.permutation import Permutation
from agoractl.data.sources import (SourceFile, common_schema, describe_error, inspect_all, list_files, read_groups,
                                   store_hint)
from agoractl.data.tokenizers import load_tokenizer
from agoractl.errors import RuntimeFailure
from agoractl.manifest.schema import Run

KEY = "__agora_key"
UNIT_BYTES = 64 << 20
"""Uncompressed bytes of input per unit of pass 1 (at least one row group)."""
SHARD_ROW_GROUP = 1000
"""Rows per row group in a shard, as in FineWeb-Edu."""
DONE_DIR = ".done"


@dataclass(frozen=True)
class Unit:
    number: int
    url: str
    first_group: int
    stop_group: int
    row_offset: int
    """Global position of the unit's first row in the concatenated input."""


@dataclass
class Config:
    """What workers need."""

    run: Run
    fingerprint: str
    output: str
    work: str
    schema: pa.Schema
    total_rows: int
    num_shards: int
    seed: int
    text_column: str
    min_int_score: Optional[int]


@dataclass
class Result:
    index: ShardIndex
    url: str
    written: int
    """Shards written by this run (the rest were already complete and verified)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per pass: inspect (listing, footers, checks), deal, write; and total."""
    input_bytes: int = 0
    """Bytes of parquet input."""


# -- planning ------------------------------------------------------------------------------------

def plan_units(files: list[SourceFile], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    units, offset = [], 0
    for f in files:
        g = 0
        while g < len(f.row_groups):
            stop, size = g, 0
            while stop < len(f.row_groups) and (stop == g or size + f.group_bytes[stop] <= unit_bytes):
                size += f.group_bytes[stop]
                stop += 1
            units.append(Unit(len(units), f.url, g, stop, offset))
            offset += sum(f.row_groups[g:stop])
            g = stop
    return units


def fingerprint(run: Run, files: list[SourceFile], tokenizer: dict[str, Any]) -> str:
    d = run.data
    body = {"format": FORMAT, "seed": d.seed, "num_shards": d.num_shards, "text": d.text_column, "id": d.id_column,
            "min_int_score": d.min_int_score, "tokenizer": tokenizer,
            "sources": [[f.url, f.size, f.rows, f.row_groups] for f in files]}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def default_work_dir(output: str, shared: bool = False) -> str:
    """Where spill files go. `shared` (a cluster's executor): under the output's own prefix, where
    every worker can read them. Otherwise on this machine, memory-mapped: beside local shards, else
    in the user's cache."""
    if shared or not storage.is_remote(output):
        return storage.join(output, ".work") if storage.is_remote(output) else \
            os.path.join(remote.filesystem(output)[1], ".work")
    cache = os.environ.get("AGORA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "agoractl")
    return os.path.join(cache, "shard-work", hashlib.sha256(output.encode()).hexdigest()[:16])


# -- pass 1: deal ----------------------------------------------------------------------------------

def _has_text(text: pa.ChunkedArray) -> np.ndarray:
    """Rows whose text is not null, empty or only whitespace.

    Only short texts can be whitespace-only in practice, so only those are trimmed (trimming every
    document would copy the whole column).
    """
    lengths = pc.fill_null(pc.binary_length(text), 0).to_numpy(zero_copy_only=False)
    out = lengths > 0
    short = np.flatnonzero(out & (lengths <= 256))
    if len(short):
        some = pc.utf8_length(pc.utf8_trim_whitespace(text.take(pa.array(short)))).to_numpy(zero_copy_only=False)
        out[short] = some > 0
    return out


def deal_unit(cfg: Config, unit: Unit) -> dict[str, Any]:
    """Pass 1 for one unit; returns its marker (already stored when this returns)."""
    done = spill.finished(cfg.work, unit.number, cfg.fingerprint)
    if done:
        return done
    table = read_groups(unit.url, range(unit.first_group, unit.stop_group), cfg.schema.names).cast(cfg.schema)
    n = table.num_rows
    nonempty = _has_text(table.column(cfg.text_column))
    keep = nonempty
    dropped_score = 0
    if cfg.min_int_score is not None:
        scored = pc.fill_null(pc.greater_equal(table.column("int_score"), cfg.min_int_score), False)
        scored = scored.to_numpy(zero_copy_only=False)
        dropped_score = int((keep & ~scored).sum())
        keep = keep & scored
    dropped_empty = int(n - nonempty.sum())
    rows = np.flatnonzero(keep)
    p = Permutation(cfg.total_rows, cfg.seed)(rows + unit.row_offset)
    shard, key = p % cfg.num_shards, p // cfg.num_shards
    order = np.argsort(shard, kind="stable")
    # One gather does the filtering and the grouping by shard: the unit's text is copied once.
    table = table.take(pa.array(rows[order])).append_column(KEY, pa.array(key[order])).combine_chunks()
    spans, size = spill.write_unit(cfg.work, unit.number, table, shard[order])
    body = {"fingerprint": cfg.fingerprint, "spill_format": spill.SPILL_FORMAT, "unit": unit.number,
            "url": unit.url, "rows_in": n, "rows": int(keep.sum()),
            "dropped": {"empty": dropped_empty, "min_int_score": dropped_score}, "spans": spans,
            "spill_bytes": size}
    spill.write_json(spill.unit_urls(cfg.work, unit.number)[1], body)
    return body


# -- pass 2: write ---------------------------------------------------------------------------------

def done_url(output: str, k: int) -> str:
    return storage.join(output, DONE_DIR, f"shard-{k:05d}.json")


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_shard(output: str, entry: ShardEntry, sizes: Optional[dict[str, int]] = None) -> bool:
    """A shard on storage is the one `entry` describes: sha256 locally, size on an object store
    (objects are uploaded whole, so a complete upload of the right size is the shard). `sizes` is
    a listing of the output, to spare one request per shard."""
    url = storage.join(output, entry.name)
    if storage.is_remote(url):
        sizes = sizes if sizes is not None else remote.listing(output)
        return sizes.get(entry.name) == entry.bytes
    path = remote.filesystem(url)[1]
    try:
        return os.path.getsize(path) == entry.bytes and _sha256_file(path) == entry.sha256
    except OSError:
        return False


def read_done(output: str, fp: str, num_shards: int) -> dict[int, ShardEntry]:
    """The shards whose marker belongs to this fingerprint and whose file verifies."""
    sizes = remote.listing(output)
    out = {}
    for name in remote.listing(storage.join(output, DONE_DIR)):
        if not (name.startswith("shard-") and name[6:11].isdigit()) or int(name[6:11]) >= num_shards:
            continue
        try:
            body = json.loads(remote.read_bytes(storage.join(output, DONE_DIR, name)))
        except (OSError, ValueError):
            continue
        if body.get("fingerprint") == fp:
            entry = ShardEntry(**body["entry"])
            if verify_shard(output, entry, sizes):
                out[int(name[6:11])] = entry
    return out


def write_done(output: str, k: int, fp: str, entry: ShardEntry) -> None:
    body = json.dumps({"fingerprint": fp, "entry": asdict(entry)}).encode()
    remote.write_bytes(done_url(output, k), body, durable=False)  # trusted only once the shard verifies


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(run: Run):
    """Loaded once per tokenizer configuration (shared by the worker threads)."""
    key = run.tokenizer.model_dump_json()
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(run)
    return _TOKENIZERS[key]


def _low_cardinality(table: pa.Table, cfg: Config) -> list[str]:
    """Columns worth dictionary-encoding: not the document text, not per-document identifiers
    (a dictionary of unique values only costs time before the writer falls back)."""
    if table.num_rows == 0:
        return []
    sample = table.slice(0, 1000)
    return [c for c in table.column_names if c not in (cfg.text_column, cfg.run.data.id_column)
            and pc.count_distinct(sample.column(c)).as_py() <= sample.num_rows // 4]


def _with_statistics(table: pa.Table, cfg: Config) -> list[str]:
    """Min/max statistics for every column but the text (long strings, never filtered on)."""
    return [c for c in table.column_names if c != cfg.text_column]


def pieces_of(markers: list[dict[str, Any]], k: int) -> list[tuple[int, int, int]]:
    """Where shard k's documents are: ``(unit, offset, length)`` in each unit's spill that has some."""
    return [(m["unit"], *m["spans"][str(k)]) for m in markers if str(k) in m["spans"]]


def write_shard(cfg: Config, k: int, pieces: list[tuple[int, int, int]]) -> ShardEntry:
    """Pass 2 for shard k; the shard and its marker are on storage when this returns."""
    name = shard_name(k)
    spill_schema = cfg.schema.append(pa.field(KEY, pa.int64()))
    parts = [spill.read_piece(cfg.work, u, offset, length) for u, offset, length in pieces]
    table = pa.concat_tables(parts) if parts else spill_schema.empty_table()
    del parts
    table = table.take(pc.sort_indices(table.column(KEY))).drop_columns([KEY])  # copies: the pieces go
    lengths = _tokenizer(cfg.run).lengths_arrow(table.column(cfg.text_column))
    tokens = int(lengths.sum()) + table.num_rows
    is_remote = storage.is_remote(cfg.output)
    url = storage.join(cfg.output, name)
    fs, path = remote.filesystem(url)
    # A remote shard is made in this machine's temporary directory (one at a time) and uploaded whole.
    tmp_dir = tempfile.gettempdir() if is_remote else os.path.dirname(path)
    os.makedirs(tmp_dir, exist_ok=True)
    tmp = os.path.join(tmp_dir, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        pq.write_table(table, tmp, row_group_size=SHARD_ROW_GROUP, compression="snappy",
                       use_dictionary=_low_cardinality(table, cfg), write_statistics=_with_statistics(table, cfg))
        if pq.ParquetFile(tmp).metadata.num_rows != table.num_rows:
            raise RuntimeFailure(f"{tmp}: wrote {table.num_rows} rows but reads back fewer",
                                 hint="check the disk (full?) and rerun")
        entry = ShardEntry(name, table.num_rows, tokens, os.path.getsize(tmp), _sha256_file(tmp))
        if is_remote:
            fs.put_file(tmp, path)  # an object appears whole or not at all
            os.remove(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    write_done(cfg.output, k, cfg.fingerprint, entry)
    return entry


# -- driver ----------------------------------------------------------------------------------------

def _check_output(output: str) -> None:
    fs, path = remote.filesystem(output)
    try:
        if storage.is_remote(output):
            bucket = path.split("/", 1)[0]
            if not fs.exists(bucket):
                raise RuntimeFailure(f"data.output {output}: the bucket {bucket!r} does not exist",
                                     hint="create it first, or point data.output elsewhere")
        else:
            os.makedirs(path, exist_ok=True)
    except RuntimeFailure:
        raise
    except Exception as e:
        raise RuntimeFailure(f"data.output: {describe_error(output, e)}", hint=store_hint(output))


def _stale(names: list[str], done: list[str], num_shards: int) -> list[str]:
    """Shard files and markers beyond num_shards, and temporaries left by a killed run."""
    out = [n for n in names if n.startswith(".shard-") and n.endswith(".tmp")]
    out += [n for n in names if n.startswith("shard-") and n.endswith(".parquet") and n[6:11].isdigit()
            and int(n[6:11]) >= num_shards]
    out += [f"{DONE_DIR}/{n}" for n in done if n[6:11].isdigit() and int(n[6:11]) >= num_shards]
    return out


def _prepare_work(work: str, fp: str, unit_bytes: int, output: str, source: str) -> None:
    """Keep the work directory of an interrupted run of this configuration; clear anything else."""
    plan_url = storage.join(work, "plan.json")
    body = {"fingerprint": fp, "unit_bytes": unit_bytes, "spill_format": spill.SPILL_FORMAT}
    old = spill.read_json(plan_url) or {}
    if any(old.get(k) != v for k, v in body.items()):
        spill.clear(work)
        spill.write_json(plan_url, {**body, "output": output, "source": source})


def heldout(num_shards: int, count: int) -> list[int]:
    """The held-out shards: the last `count` (they are pre-shuffled like every other)."""
    return list(range(num_shards - count, num_shards))


def reshard(run: Run, jobs: int = 1, progress: Optional[Progress] = None, work_dir: Optional[str] = None,
            unit_bytes: int = UNIT_BYTES, executor: Optional[Executor] = None) -> Result:
    """Re-shard ``run.data.source`` into ``run.data.num_shards`` shards under ``run.data.output``.

    `executor` runs the tasks (default: ``jobs`` local threads); `work_dir` is a local directory or a
    store URL for the spill files (default: :func:`default_work_dir`, shared for a cluster).
    """
    own = executor is None
    executor = executor or LocalExecutor(jobs)
    try:
        return _reshard(run, executor, progress, work_dir, unit_bytes)
    finally:
        if own:
            executor.close()


def _reshard(run: Run, executor: Executor, progress: Optional[Progress], work_dir: Optional[str],
             unit_bytes: int) -> Result:
    t0 = time.perf_counter()
    d = run.data
    tokenizer = load_tokenizer(run).describe()
    urls = list_files(d.source)
    files = inspect_all(urls, d.text_column, d.id_column, need_int_score=d.min_int_score is not None)
    fp = fingerprint(run, files, tokenizer)
    output = d.output
    _check_output(output)
    num = d.num_shards
    input_bytes = sum(f.size for f in files)
    try:
        existing: Optional[ShardIndex] = read_index(output)
    except RuntimeFailure:  # none, or unreadable: either way it is replaced below
        existing = None
    listed = remote.listing(output)
    if existing and existing.fingerprint == fp and all(verify_shard(output, e, listed) for e in existing.shards):
        if existing.heldout != heldout(num, d.heldout_shards):  # only the held-out split changed
            existing.heldout = heldout(num, d.heldout_shards)
            write_index(output, existing)
        return Result(existing, index_url(output), 0, {"total": time.perf_counter() - t0}, input_bytes)
    if existing and existing.fingerprint == fp:
        for k, e in enumerate(existing.shards):  # keep the good shards of a damaged corpus
            if verify_shard(output, e, listed):
                write_done(output, k, fp, e)
    # Anything that will change must first stop being claimed by an index.
    if "index.json" in listed:
        remote.remove(index_url(output))
    for name in _stale(list(listed), list(remote.listing(storage.join(output, DONE_DIR))), num):
        remote.remove(storage.join(output, name))

    work = work_dir or default_work_dir(output, shared=not isinstance(executor, LocalExecutor))
    _prepare_work(work, fp, unit_bytes, output, d.source)
    schema = common_schema(files, d.text_column, d.id_column)
    cfg = Config(run, fp, output, work, schema, sum(f.rows for f in files), num, d.seed, d.text_column,
                 d.min_int_score)
    units = plan_units(files, unit_bytes)
    done = read_done(output, fp, num)
    entries: list[Optional[ShardEntry]] = [done.get(k) for k in range(num)]
    todo = [k for k in range(num) if entries[k] is None]
    seconds = {"inspect": time.perf_counter() - t0}
    if progress:
        progress("input", input_bytes, input_bytes)  # the bytes both passes go through, for MB/s
    t1 = time.perf_counter()
    markers = executor.map(deal_unit, cfg, [(u,) for u in units], "deal", progress)
    seconds["deal"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    written = executor.map(write_shard, cfg, [(k, pieces_of(markers, k)) for k in todo], "write", progress)
    seconds["write"] = time.perf_counter() - t1
    for k, e in zip(todo, written):
        entries[k] = e

    dropped = {"empty": sum(m["dropped"]["empty"] for m in markers),
               "min_int_score": sum(m["dropped"]["min_int_score"] for m in markers)}
    shards = [e for e in entries if e is not None]
    index = ShardIndex(fingerprint=fp, seed=d.seed, num_shards=num, text_column=d.text_column,
                       id_column=d.id_column, min_int_score=d.min_int_score, tokenizer=tokenizer,
                       sources=[{"url": f.url, "bytes": f.size, "rows": f.rows} for f in files],
                       rows=sum(e.rows for e in shards), tokens=sum(e.tokens for e in shards), dropped=dropped,
                       shards=shards, heldout=heldout(num, d.heldout_shards))
    url = write_index(output, index)
    # The index now vouches for the shards: markers and spills are no longer needed.
    remote.remove(storage.join(output, DONE_DIR), recursive=True)
    spill.clear(work)
    seconds["total"] = time.perf_counter() - t0
    return Result(index, url, len(todo), seconds, input_bytes)
