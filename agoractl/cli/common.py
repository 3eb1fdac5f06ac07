"""Options shared by every command (as reusable ``Annotated`` aliases) and manifest loading."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from agoractl.errors import UsageError
from agoractl.manifest.loader import load_manifest
from agoractl.manifest.schema import Run

ManifestArg = Annotated[Path, typer.Argument(help="Run manifest (YAML).", show_default=False)]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="Override a manifest field before validation: dotted.path=value (repeatable).",
                 show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout; no colour, no progress.")]


def load(path: Path, overrides: Optional[list[str]]) -> Run:
    """Load and validate a manifest with --set overrides (raises ManifestError, exit 2)."""
    return load_manifest(path, overrides or [])


def stage_index(run: Run, stage: str) -> int:
    """The index of --stage STAGE in the run, or a usage error naming the stages (exit 2)."""
    try:
        return run.stage(stage)[0]
    except KeyError as e:
        raise UsageError(f"--stage: {e.args[0]}") from None
