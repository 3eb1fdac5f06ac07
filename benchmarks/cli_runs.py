"""Helpers the benchmarks share to run agoractl commands: a command's JSON output, `--set` arguments, and the
result file written whole or not at all.

Imported by the scripts in this directory when run as ``python benchmarks/<script>.py`` (their directory is
then first on ``sys.path``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def agoractl(*args: str, timeout: float = 1800) -> dict:
    """Run `agoractl ARGS --json` in the checkout; its JSON output, or exit with its stderr's tail."""
    proc = subprocess.run([sys.executable, "-m", "agoractl", *args, "--json"], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"agoractl {' '.join(args[:2])} failed with exit code {proc.returncode}")
    return json.loads(proc.stdout)


def sets(values: list[str]) -> list[str]:
    """`--set v` for each manifest override v."""
    return [a for v in values for a in ("--set", v)]


def unread(shards: Path) -> None:
    """Forget every claim on the shards at `shards` (``<data.output>/claims``, the run's data ledger), so that
    the next run reads the data from its beginning: runs of one benchmark then train the same samples, and
    many runs never exhaust the data's epochs (a trainer with no shard left ends the run)."""
    shutil.rmtree(Path(shards) / "claims", ignore_errors=True)


def sample_shards(tmp: Path, manifest: Path, rows: int = 2000, shards: int = 4) -> list[str]:
    """Generate a sample corpus of `rows` documents under `tmp` and shard it into `shards` shards; the manifest
    overrides (``data.source``, ``data.output``, ``data.num_shards``) that train on them."""
    agoractl("data", "sample", "--out", str(tmp / "sample"), "--rows", str(rows), "--files", "2")
    data = [f"data.source={tmp / 'sample'}/*.parquet", f"data.output={tmp / 'shards'}", f"data.num_shards={shards}"]
    agoractl("shard", str(manifest), *sets(data))
    return data


def write_json(path: Path, result: dict) -> None:
    """Write a benchmark's result to `path` atomically (a temp name, then a rename): never a half-written file."""
    part = Path(path).with_name(Path(path).name + ".tmp")
    part.write_text(json.dumps(result, indent=2))
    part.replace(path)
