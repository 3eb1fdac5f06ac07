"""The root of the ``agoractl`` command line: registers the command groups and maps errors to exit codes.

Exit codes: 0 success, 1 runtime failure, 2 invalid usage or manifest. A known error prints one line
(and what to do next) on stderr; a traceback only with ``AGORA_DEBUG=1``.
"""

from __future__ import annotations

import os
import sys

import typer

from agoractl import __version__
from agoractl.cli import analyze, checkpoint, data, demo, export, launch, manifest, ops, rotate, shard, simulate
from agoractl.cli import launch_nodes  # noqa: F401  registers launch dht|worker|trainer|swarm on launch.app
from agoractl.errors import AgoraError

app = typer.Typer(
    name="agoractl",
    help="Decentralized LLM pre-training, the Agora way: one run manifest, turned into actions.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(manifest.app, name="manifest")
app.add_typer(launch.app, name="launch")
app.add_typer(checkpoint.app, name="checkpoint")
app.add_typer(analyze.app, name="analyze")
app.add_typer(data.app, name="data")
app.command(name="shard")(shard.shard)
app.command(name="rotate-shards")(rotate.rotate_shards)
app.command(name="simulate")(simulate.simulate)
app.add_typer(ops.app, name="ops")
app.command(name="demo")(demo.demo)
app.command(name="export")(export.export)
app.command(name="eval")(export.evaluate)


def _version(value: bool) -> None:
    if value:
        print(f"agoractl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    from agoractl import logs

    logs.configure()


def run() -> None:
    """Console-script entry point."""
    debug = os.environ.get("AGORA_DEBUG") == "1"
    try:
        rc = app(standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except AgoraError as e:
        if debug:
            raise
        print(f"error: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # click's usage errors first (typer bundles its own click), then the unexpected
        if hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):
            if debug:
                raise
            e.show()
            sys.exit(e.exit_code)
        if debug:
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        print("hint: this is a bug or an unexpected environment; rerun with AGORA_DEBUG=1 for the traceback",
              file=sys.stderr)
        sys.exit(1)
