"""``agoractl shard FILE``: re-shard ``data.source`` into ``data.num_shards`` pre-shuffled shards."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agoractl.cli.common import JsonOpt, ManifestArg, SetOpt, load
from agoractl.cli.output import emit, human_bytes, human_count, stderr, stdout
from agoractl.data.shard import reshard
from agoractl.errors import UsageError


@contextmanager
def _progress_bar(enabled: bool) -> Iterator[Optional[callable]]:
    """A rich progress bar on stderr when it is a terminal; None otherwise."""
    if not enabled:
        yield None
        return
    labels = {"deal": "reading and dealing", "write": "writing shards"}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=stderr, transient=False) as bar:
        tasks: dict[str, int] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(labels.get(phase, phase), total=total)
            bar.update(tasks[phase], completed=done, total=total)

        yield update


def shard(
    file: ManifestArg,
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="Worker processes (default: the CPU count).")] = 0,
    work_dir: Annotated[Optional[Path], typer.Option(
        help="Local directory for spill files (default: <data.output>/.work, or the user cache for s3://).",
        show_default=False)] = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-shard data.source into data.num_shards uniformly shuffled parquet shards plus index.json.

    Deterministic for data.seed; resumable (a rerun keeps complete, verified shards); bounded memory.
    """
    if jobs < 0:
        raise UsageError(f"--jobs must be positive; got {jobs}")
    run = load(file, set_)
    jobs = jobs or os.cpu_count() or 1
    with _progress_bar(sys.stderr.isatty() and not as_json) as bar:
        result = reshard(run, jobs=jobs, progress=bar, work_dir=str(work_dir) if work_dir else None)
    idx = result.index
    data = {"shards": len(idx.shards), "rows": idx.rows, "tokens": idx.tokens,
            "dropped": sum(idx.dropped.values()), "dropped_by": idx.dropped, "index": result.url,
            "written": result.written, "output": run.data.output, "seed": idx.seed,
            "bytes": sum(s.bytes for s in idx.shards)}
    emit(data, as_json, _render)


def _render(data: dict) -> None:
    t = Table(box=None, show_header=False)
    t.add_row("shards", f"{data['shards']} ({data['written']} written, {data['shards'] - data['written']} kept)")
    t.add_row("documents", f"{data['rows']} ({data['dropped']} dropped: "
              + ", ".join(f"{k} {v}" for k, v in data["dropped_by"].items()) + ")")
    t.add_row("tokens", human_count(data["tokens"]))
    t.add_row("size", human_bytes(data["bytes"]))
    t.add_row("index", data["index"])
    stdout.print(t)
