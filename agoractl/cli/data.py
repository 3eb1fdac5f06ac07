"""``agoractl data sample``: write the synthetic sample corpus (FineWeb-Edu's parquet schema)."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from agoractl.cli.common import JsonOpt
from agoractl.cli.output import emit, human_bytes, stdout
from agoractl.data.sample import write_sample
from agoractl.errors import UsageError
from agoractl.manifest.loader import load_manifest

app = typer.Typer(
    help="Corpus utilities: the offline sample corpus in FineWeb-Edu's schema.",
    no_args_is_help=True,
    epilog="Examples:\n\n  agoractl data sample --out runs/local-cpu/sample\n\n"
           "  agoractl data sample --out /tmp/corpus --rows 100000 --files 8 --seed 1 --json",
)


@app.command()
def sample(
    out: Annotated[Path, typer.Option("--out", help="Directory to write the parquet files into.", show_default=False)],
    rows: Annotated[int, typer.Option(help="Documents in total, spread evenly over the files.")] = 8000,
    files: Annotated[int, typer.Option(help="Parquet files to write (row groups of 1,000 rows each).")] = 4,
    seed: Annotated[int, typer.Option(help="Generator seed; the same seed gives byte-identical files.")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Generate a corpus offline: templated English lessons a tiny model learns within ~100 steps."""
    if rows < 1:
        raise UsageError(f"--rows must be at least 1; got {rows}")
    if files < 1 or files > rows:
        raise UsageError(f"--files must be between 1 and --rows ({rows}); got {files}")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    written = write_sample(str(out), rows=rows, files=files, seed=seed)
    data = {"out": str(out), "files": [f.__dict__ for f in written], "rows": sum(f.rows for f in written),
            "bytes": sum(f.bytes for f in written), "seed": seed}
    emit(data, as_json, _render)


def _render(data: dict) -> None:
    table = Table("file", "rows", "size", box=None)
    for f in data["files"]:
        table.add_row(f["path"], str(f["rows"]), human_bytes(f["bytes"]))
    stdout.print(table)
    stdout.print(f"{data['rows']} documents, {human_bytes(data['bytes'])} in {data['out']} (seed {data['seed']})")


def demo_steps(manifest: Path) -> list[list[str]]:
    """The demo's data steps: write the sample corpus where data.source points (when it is a local
    glob or directory), then re-shard it."""
    source = load_manifest(manifest, []).data.source
    out = []
    if "://" not in source:
        directory = os.path.dirname(source) if glob.has_magic(source) or source.endswith(".parquet") else source
        out.append(["data", "sample", "--out", directory or "."])
    return out + [["shard", str(manifest)]]
