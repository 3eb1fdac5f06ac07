"""``agoractl launch ...``: start nodes of a run (dht, worker, trainer), a whole local swarm, or the
centralized reference. Thin: parse, call the runtime, render."""

from __future__ import annotations

import typer

app = typer.Typer(help="Start nodes of a run, a whole local swarm, or the centralized reference.",
                  no_args_is_help=True)
