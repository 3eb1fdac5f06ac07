"""The root of the ``agoractl`` command line: a table of command groups, loaded lazily, and the one
place where errors become exit codes.

A command group's module is imported only when that command runs (or its own ``--help`` is asked
for), so the command modules and the library import what they need at the top, and
``agoractl --help`` or ``agoractl manifest validate`` do not pay for torch or hivemind.

Exit codes: 0 success, 1 runtime failure, 2 invalid usage or manifest, 3 a stalled run, 130 / 143
stopped by SIGINT / SIGTERM. A known error prints one line
(and what to do next) on stderr; a traceback only with ``AGORA_DEBUG=1``.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from agoractl import __version__
from agoractl.errors import AgoraError, Interrupted, RuntimeFailure, StalledRun, UsageError

EXIT_CODES: tuple[tuple[type[AgoraError], int], ...] = (
    (UsageError, 2), (StalledRun, 3), (RuntimeFailure, 1), (AgoraError, 1))
"""Domain error -> exit code, first match wins (the only place that decides an exit code); an
:class:`~agoractl.errors.Interrupted` run exits with 128 + its signal (130 SIGINT, 143 SIGTERM)."""


def exit_code(error: AgoraError) -> int:
    """The exit code of a domain error (see :data:`EXIT_CODES`)."""
    if isinstance(error, Interrupted):
        return 128 + error.signum
    return next(code for kind, code in EXIT_CODES if isinstance(error, kind))


@dataclass(frozen=True)
class Entry:
    """One command of the root: where it lives, and the line ``agoractl --help`` shows for it."""

    module: str
    attr: str
    """A ``typer.Typer`` (a command group) or a function (a single command)."""
    help: str
    extra: tuple[str, ...] = ()
    """Modules that register more commands on the group when imported."""


COMMANDS: dict[str, Entry] = {
    "manifest": Entry("agoractl.cli.manifest", "app",
                      "Validate a run manifest, print its JSON Schema, or plan what it costs."),
    "launch": Entry("agoractl.cli.launch", "app",
                    "Start nodes of a run, a whole local swarm, or the centralized reference.",
                    extra=("agoractl.cli.launch_nodes", "agoractl.cli.launch_authorizer",
                           "agoractl.cli.launch_health", "agoractl.cli.launch_dashboard")),  # dht|worker|...
    "status": Entry("agoractl.cli.status", "status",
                    "A live summary of a running swarm from the Health Monitor's database."),
    "checkpoint": Entry("agoractl.cli.checkpoint", "app",
                        "Publish, fetch and list stage checkpoints in checkpoints.store (local, file:// or s3://)."),
    "analyze": Entry("agoractl.cli.analyze", "app",
                     "Analyse a run's outputs: inter-replica divergence from replica snapshots."),
    "data": Entry("agoractl.cli.data", "app", "Corpus utilities: the offline sample corpus in FineWeb-Edu's schema."),
    "shard": Entry("agoractl.cli.shard", "shard",
                   "Re-shard data.source into data.num_shards uniformly shuffled parquet shards plus index.json."),
    "rotate-shards": Entry("agoractl.cli.rotate", "rotate_shards",
                           "Show the shard ledger (trainers' claims); release a dead trainer's shards, or "
                           "allow another epoch."),
    "simulate": Entry("agoractl.cli.simulate", "simulate",
                      "Train replicas in this process with the workers' own algorithm code and compare the "
                      "variants."),
    "ops": Entry("agoractl.cli.ops", "app", "Operate a running swarm: fault injection and churn."),
    "export": Entry("agoractl.cli.export", "export",
                    "Assemble the run's model into a Hugging Face LlamaForCausalLM directory."),
    "eval": Entry("agoractl.cli.export", "evaluate",
                  "Validation loss and perplexity of the latest checkpoint on the held-out shards."),
    "auth": Entry("agoractl.cli.auth", "app",
                  "The authority's keys and a running Authorizer: policy, report, nodes, bans."),
    "demo": Entry("agoractl.cli.demo", "demo",
                  "Run the embedded default (manifests/local-cpu.yaml) end to end with the public commands."),
}
"""The root's commands, in ``--help`` order; each module is imported only when its command runs."""


def load_command(name: str) -> TyperCommand | TyperGroup:
    """Import the module of command `name` and build its click command, exactly as the root registers it."""
    entry = COMMANDS[name]
    target = getattr(importlib.import_module(entry.module), entry.attr)
    for module in entry.extra:
        importlib.import_module(module)
    holder = typer.Typer(add_completion=False)
    if isinstance(target, typer.Typer):
        holder.add_typer(target, name=name)
    else:
        holder.command(name=name)(target)
    return typer.main.get_group(holder).commands[name]


class _LazyGroup(TyperGroup):
    """A group whose commands are placeholders (name and help line) until one is invoked."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        for name, entry in COMMANDS.items():
            self.commands[name] = TyperCommand(name, help=entry.help, short_help=entry.help)
        self._loaded: set[str] = set()

    def resolve_command(self, ctx: Any, args: list[str]) -> tuple:
        name, cmd, rest = super().resolve_command(ctx, args)
        if name in COMMANDS and name not in self._loaded:
            cmd = self.commands[name] = load_command(name)
            self._loaded.add(name)
        return name, cmd, rest


app = typer.Typer(
    name="agoractl",
    cls=_LazyGroup,
    help="Decentralized LLM pre-training, the Agora way: one run manifest, turned into actions.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        print(f"agoractl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    from agoractl import logs  # structlog: only when a command runs, not for --help

    logs.configure()


def run() -> None:
    """Console-script entry point: run the command, map every error to one line and an exit code."""
    # Start-up allocates millions of long-lived objects (torch, hivemind, torch.optim's dynamo): with the
    # default gen-0 threshold (700) the collector rescans them over and over, about 0.8 s of CPU per node
    # process here. Collect rarely until a node is up (a worker restores the defaults once ready).
    gc.set_threshold(100_000, 50, 100)
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
        sys.exit(exit_code(e))
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        if debug:
            raise
        if hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):
            # click's usage errors (typer bundles its own click): bad option, choice, argument
            _usage_error(e)
            sys.exit(e.exit_code)
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        print("hint: this is a bug or an unexpected environment; rerun with AGORA_DEBUG=1 for the traceback",
              file=sys.stderr)
        sys.exit(1)


def _usage_error(e: Exception) -> None:
    """A usage error found by click (unknown option, a value not among an Enum's, a missing argument) as
    the same one line and hint as every other error; a group called without a command shows its help."""
    ctx = getattr(e, "ctx", None)
    if ctx is None or type(e).__name__ == "NoArgsIsHelpError":
        e.show()
        return
    names = []
    while ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    print(f"error: {e.format_message().replace('Value error, ', '')}", file=sys.stderr)
    print(f"hint: `{' '.join(['agoractl', *reversed(names)])} --help` lists the arguments, options and their values",
          file=sys.stderr)
