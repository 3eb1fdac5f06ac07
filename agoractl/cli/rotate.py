"""``agoractl rotate-shards FILE``: give exhausted trainers fresh shards (report §5.1.0.3)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from agoractl.cli.common import JsonOpt, ManifestArg, SetOpt, load
from agoractl.cli.output import emit, note, stdout
from agoractl.data.index import read_index
from agoractl.data.ledger import rotate_shards as rotate


def rotate_shards(
    file: ManifestArg,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would change; write nothing.")] = False,
    wrap: Annotated[bool, typer.Option(
        "--wrap", help="When the corpus is used up, start the next epoch (shard order from a new seed).")] = False,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Fold trainers' consumption reports into ledger.json and reassign trainers whose shards are exhausted.

    A shard is exhausted when fewer than model.seq_len + 1 of its tokens remain; a trainer when all
    its shards are. Exhausted trainers get the next unassigned shards in order; the others are left
    alone. Live trainers pick the new assignment up without a restart.
    """
    run = load(file, set_)
    index = read_index(run.data.output)
    data = rotate(run.data.output, index, run.trainers.count, run.trainers.shards_per_trainer, run.model.seq_len,
                  run.data.seed, wrap=wrap, dry_run=dry_run)
    emit(data, as_json, _render)
    if data["corpus_used_up"]:
        note(f"corpus used up: trainer(s) {', '.join(map(str, data['starved']))} have no shard left in epoch "
             f"{data['epoch']}; rerun with --wrap to start epoch {data['epoch'] + 1}")


def _render(data: dict) -> None:
    t = Table("trainer", "shards", "consumed", "state", box=None)
    for tr in data["trainers"]:
        used = sum(tr["consumed"])
        total = sum(tr["tokens"]) or 1
        t.add_row(str(tr["trainer"]), " ".join(map(str, tr["shards"])) or "-", f"{100 * used / total:.0f}%",
                  "exhausted" if tr["exhausted"] else "reading")
    stdout.print(t)
    for r in data["rotated"]:
        stdout.print(f"trainer {r['trainer']}: shards {' '.join(map(str, r['from'])) or '-'} -> "
                     f"{' '.join(map(str, r['to'])) or '-'}")
    verb = "would change" if data["dry_run"] else "changed"
    stdout.print(f"{data['ledger']}: {verb if data['changed'] else 'unchanged'} "
                 f"(epoch {data['epoch']}, {data['unassigned']} shard(s) unassigned)")
