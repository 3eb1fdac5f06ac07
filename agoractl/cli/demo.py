"""``agoractl demo``: the embedded default manifest, end to end, one public command after another, ending with
the Dashboard's URL and a screenshot of it (``<local.run_dir>/dashboard.png``).

Each step is an ordinary ``agoractl`` command line; the demo prints it, then runs it as a
subprocess, and stops at the first failure with that step's exit code. After the swarm it prints the
swarm's tokens/s beside central's, from the two runs' reports (``central-report.json``,
``swarm-report.json`` in ``local.run_dir``).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from agoractl.cli.data import demo_steps as data_steps
from agoractl.errors import RuntimeFailure, UsageError

DEFAULT_MANIFEST = "local-cpu.yaml"


def manifests_dir() -> Path:
    """Shipped manifests: inside the installed package, or at the top of a source checkout."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "manifests", here.parent / "manifests"):
        if candidate.is_dir():
            return candidate
    raise RuntimeFailure("the shipped manifests are missing from this installation",
                         hint="reinstall agoractl (pip install -e .)")


def default_manifest() -> Path:
    return manifests_dir() / DEFAULT_MANIFEST


def screenshot_path(manifest: Path) -> str:
    """Where the demo's screenshot of the Dashboard goes: ``<local.run_dir>/dashboard.png``."""
    from agoractl.manifest.loader import load_manifest

    return str(Path(load_manifest(manifest).local.run_dir) / "dashboard.png")


def steps(manifest: Path) -> list[list[str]]:
    """The demo's command lines, in order. Each capability adds its step here."""
    m = str(manifest)
    return [
        ["manifest", "validate", m],
        ["manifest", "plan", m],
        *data_steps(manifest),
        # --fresh --force: a second demo starts over (the first one's checkpoints are moved aside).
        ["launch", "central", m, "--set", "training.max_steps=20", "--fresh", "--force"],
        # Two replicas per stage, so that SPARTA averages and the replicas' snapshots can be compared; the Health
        # Monitor, Prometheus and the Dashboard beside them (it prints its URL).
        ["launch", "swarm", m, "--set", "training.max_steps=20", "--set", "local.workers_per_stage=2",
         "--set", "monitoring.enabled=true", "--set", "dashboard.enabled=true", "--fresh", "--force"],
        ["checkpoint", "list", m],
        ["analyze", "divergence", m, "--stage", "head"],
        ["simulate", m, "--scenario", "fgdiloco", "--rounds", "4", "--inner-steps", "4", "--set", "model.seq_len=64"],
        # Last: the Dashboard on the swarm's health database: its URL, and a screenshot of it.
        ["launch", "dashboard", m, "--screenshot", screenshot_path(manifest)],
    ]


def ratio_line(run_dir: Path) -> str:
    """One line comparing the demo's swarm with its central run, from their reports in `run_dir`."""
    try:
        central = json.loads((run_dir / "central-report.json").read_text())["tokens_per_s"]
        swarm = json.loads((run_dir / "swarm-report.json").read_text())["tokens_per_s"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"swarm/central: no ratio ({type(e).__name__}: {e})"
    if not central or swarm is None:
        return "swarm/central: no ratio (a run reports no tokens/s)"
    return (f"swarm/central: {swarm:,.0f} / {central:,.0f} tokens/s = {swarm / central:.2f} (this machine; the swarm "
            "runs 2 workers per stage and the monitors beside them; equal-hardware figures: "
            "benchmarks/swarm_vs_central.py)")


def demo(
    manifest: Annotated[Optional[Path], typer.Option(help="Manifest to run instead of the embedded default.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the commands without running them.")] = False,
) -> None:
    """Run the embedded default (manifests/local-cpu.yaml) end to end with the public commands."""
    path = manifest or default_manifest()
    if not path.is_file():
        raise UsageError(f"{path}: no such manifest file")
    for args in steps(path):
        line = "agoractl " + shlex.join(args)
        print(f"$ {line}", flush=True)
        if dry_run:
            continue
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, "-m", "agoractl", *args])
        if rc != 0:
            raise RuntimeFailure(f"demo step failed with exit code {rc}: {line}",
                                 hint="rerun that command alone to see its output")
        print(f"  ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
        if args[:2] == ["launch", "swarm"]:
            from agoractl.manifest.loader import load_manifest

            print(ratio_line(Path(load_manifest(path).local.run_dir)), flush=True)
