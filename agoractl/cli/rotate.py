"""``agoractl rotate-shards FILE``: the shard ledger for operators (report §5.1.0.3).

Trainers rotate by themselves (they claim the next shards from ``<data.output>/claims/``); this
command shows the ledger, gives a dead trainer's shards back to the pool at once (``--release``,
instead of waiting out its lease), and forces another epoch (``--wrap``)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from agoractl.cli.common import JsonOpt, ManifestArg, SetOpt, load
from agoractl.cli.output import emit, note, stdout
from agoractl.data.claim_store import claim_store
from agoractl.data.claims import CLAIMS_DIR, allow_epochs, ledger_state, release_trainer
from agoractl.data.index import read_index
from agoractl.errors import UsageError


def rotate_shards(
    file: ManifestArg,
    release: Annotated[Optional[int], typer.Option(
        "--release", help="End the leases of this trainer's claims now (a dead trainer): the next trainer "
                          "takes them over where it stopped.", min=0, show_default=False)] = None,
    wrap: Annotated[bool, typer.Option(
        "--wrap", help="Allow one more epoch than data.epochs (or than the last --wrap): trainers go on into "
                       "it, with a new shard order from the seed.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the ledger; change nothing.")] = False,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show the shard ledger (trainers' claims); release a dead trainer's shards, or allow another epoch.

    Per epoch: claims, done, expired. Live trainers pick the change up without a restart."""
    run = load(file, set_)
    if dry_run and (release is not None or wrap):
        raise UsageError("--dry-run changes nothing: drop --release / --wrap, or --dry-run")
    index = read_index(run.data.output)
    store = claim_store(run.data.output)
    released: list = []
    if release is not None:
        released = [{"shard": s, "epoch": e} for s, e in release_trainer(store, release)]
    before = ledger_state(store, index.training, run.data.epochs)["allowed_epochs"]
    allowed = allow_epochs(store, before + 1) if wrap else before
    data = {"ledger": f"{run.data.output.rstrip('/')}/{CLAIMS_DIR}", "released": released,
            **ledger_state(store, index.training, run.data.epochs), "allowed_epochs": allowed,
            "shards": index.training, "dry_run": dry_run}
    emit(data, as_json, _render)
    if release is not None and not released:
        note(f"trainer {release} holds no open claim")


def _render(data: dict) -> None:
    t = Table("epoch", "claimed", "done", "unclaimed", "open claims (shard: trainer, read)", box=None)
    for e in data["epochs"]:
        open_ = [f"{c['shard']}: t{c['trainer']} {100 * c['consumed'] / max(1, c['tokens']):.0f}%"
                 f"{' expired' if c['expired'] else ''}" for c in e["claims"] if not c["done"]]
        t.add_row(str(e["epoch"]), str(e["claimed"]), str(e["done"]), str(e["unclaimed"]), ", ".join(open_) or "-")
    stdout.print(t)
    for r in data["released"]:
        stdout.print(f"released shard {r['shard']} (epoch {r['epoch']})")
    stdout.print(f"{data['ledger']}: {data['shards']} shards, {data['allowed_epochs']} epoch(s) allowed")
