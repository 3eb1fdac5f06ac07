"""``agoractl shard FILE``: re-shard ``data.source`` into ``data.num_shards`` pre-shuffled shards.

    agoractl shard run.yaml                                       # local threads (--jobs, default: CPUs)
    agoractl shard run.yaml --executor dask --address tcp://scheduler:8786
    agoractl shard run.yaml --plan                                # what it would read, write and need
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Annotated, Iterator, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, \
    TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from agoractl.cli.common import JsonOpt, ManifestArg, SetOpt, load
from agoractl.cli.output import emit, human_bytes, human_count, stderr, stdout
from agoractl.data.executors import EXECUTORS, make_executor
from agoractl.data.shard import reshard
from agoractl.data.shard_plan import plan as make_plan
from agoractl.errors import UsageError


class _Rate(ProgressColumn):
    """MB/s of input through this pass (each pass goes through the whole input once)."""

    def __init__(self, input_bytes: list[int]):
        super().__init__()
        self.input_bytes = input_bytes

    def render(self, task) -> Text:
        if not task.total or not task.elapsed or not self.input_bytes[0]:
            return Text("")
        mb = self.input_bytes[0] * task.completed / task.total / 1e6
        return Text(f"{mb / task.elapsed:.1f} MB/s")


@contextmanager
def _progress_bar(enabled: bool) -> Iterator[Optional[callable]]:
    """A rich progress bar on stderr when it is a terminal; None otherwise."""
    if not enabled:
        yield None
        return
    labels = {"deal": "units read and dealt", "write": "shards written"}
    input_bytes = [0]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), _Rate(input_bytes),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=stderr,
                  transient=False) as bar:
        tasks: dict[str, int] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase == "input":
                input_bytes[0] = total
                return
            if phase not in tasks:
                tasks[phase] = bar.add_task(labels.get(phase, phase), total=total)
            bar.update(tasks[phase], completed=done, total=total)

        yield update


def shard(
    file: ManifestArg,
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="Worker threads of --executor local (default: the CPU count).")] = 0,
    executor: Annotated[str, typer.Option(
        help="Where the tasks run: local (threads here) or dask (a Dask distributed cluster, see --address).")] = "local",
    address: Annotated[Optional[str], typer.Option(
        help="Dask scheduler for --executor dask, e.g. tcp://10.0.0.5:8786 (default: $DASK_SCHEDULER_ADDRESS).",
        show_default=False)] = None,
    work_dir: Annotated[Optional[str], typer.Option(
        help="Spill files: a local directory or a store URL (default: <data.output>/.work for local output or "
             "--executor dask, else the user cache).", show_default=False)] = None,
    plan: Annotated[bool, typer.Option("--plan", help="Print what would be read, written and needed; write nothing.")] = False,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-shard data.source into data.num_shards uniformly shuffled parquet shards plus index.json.

    Deterministic for data.seed, whatever the executor and its workers; resumable (a rerun keeps
    finished units and complete, verified shards); memory per worker bounded by one unit and one shard.
    """
    if jobs < 0:
        raise UsageError(f"--jobs must be positive; got {jobs}")
    if executor not in EXECUTORS:
        raise UsageError(f"--executor must be one of {', '.join(EXECUTORS)}; got {executor!r}")
    if address and executor != "dask":
        raise UsageError("--address names a Dask scheduler: add --executor dask")
    run = load(file, set_)
    jobs = jobs or os.cpu_count() or 1
    if plan:
        emit(make_plan(run, workers=jobs if executor == "local" else 1), as_json, _render_plan)
        return
    t0 = time.perf_counter()
    ex = make_executor(executor, jobs=jobs, address=address)
    try:
        with _progress_bar(sys.stderr.isatty() and not as_json) as bar:
            result = reshard(run, progress=bar, work_dir=work_dir, executor=ex)
    finally:
        ex.close()
    idx = result.index
    seconds = {k: round(v, 3) for k, v in {**result.seconds, "total": time.perf_counter() - t0}.items()}
    data = {"shards": len(idx.shards), "heldout": idx.heldout, "rows": idx.rows, "tokens": idx.tokens,
            "dropped": sum(idx.dropped.values()), "dropped_by": idx.dropped, "index": result.url,
            "written": result.written, "output": run.data.output, "seed": idx.seed,
            "bytes": sum(s.bytes for s in idx.shards), "executor": executor, "workers": ex.workers,
            "input_bytes": result.input_bytes, "seconds": seconds,
            "mb_per_s": round(result.input_bytes / 1e6 / seconds["total"], 2) if result.written else None}
    emit(data, as_json, _render)


def _render(data: dict) -> None:
    t = Table(box=None, show_header=False)
    t.add_row("shards", f"{data['shards']} ({data['written']} written, {data['shards'] - data['written']} kept)"
              + (f"; held out for `agoractl eval`: {', '.join(map(str, data['heldout']))}" if data["heldout"] else ""))
    t.add_row("documents", f"{data['rows']} ({data['dropped']} dropped: "
              + ", ".join(f"{k} {v}" for k, v in data["dropped_by"].items()) + ")")
    t.add_row("tokens", human_count(data["tokens"]))
    t.add_row("size", human_bytes(data["bytes"]))
    t.add_row("executor", f"{data['executor']} ({data['workers']} workers)")
    s = data["seconds"]
    t.add_row("time", f"{s['total']:.1f} s" + (f" (deal {s['deal']:.1f} s, write {s['write']:.1f} s, "
                                                f"{data['mb_per_s']} MB/s)" if "deal" in s else ""))
    t.add_row("index", data["index"])
    stdout.print(t)


def _render_plan(p: dict) -> None:
    t = Table(box=None, show_header=False)
    t.add_row("input", f"{p['files']} files, {human_bytes(p['input_bytes'])} parquet "
              f"({human_bytes(p['uncompressed_bytes'])} uncompressed), {p['rows']} documents")
    t.add_row("tokens", f"~{human_count(p['estimated_tokens'])} (measured on the first row group)")
    t.add_row("shards", f"{p['shards']} of ~{p['rows_per_shard']:.0f} documents, ~{human_bytes(p['bytes_per_shard'])}")
    t.add_row("spill", f"{human_bytes(p['spill_bytes'])} under the work directory; {p['units']} units "
              f"(largest {human_bytes(p['unit_bytes_max'])}); at most {p['spill_reads']} piece reads")
    m = p["memory"]
    t.add_row("memory per worker", f"<= {human_bytes(p['memory_per_worker_bytes'])} per task thread "
              f"(process {human_bytes(m['base'])} + max(deal {human_bytes(m['deal'])}, write {human_bytes(m['write'])}))")
    t.add_row("time", f"~{p['estimated_seconds']:.0f} s at {p['rate_mb_per_s']:.0f} MB/s "
              f"(the local rate, {p['workers']} cores; a cluster divides it by its workers)")
    t.add_row("output", p["output"])
    stdout.print(t)
