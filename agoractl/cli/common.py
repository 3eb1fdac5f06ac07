"""Options shared by every command (as reusable ``Annotated`` aliases) and manifest loading."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

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
