"""``agoractl status FILE``: a live summary of a running swarm from the Health Monitor's database."""

from __future__ import annotations

from agoractl.cli.common import JsonOpt, ManifestArg, SetOpt, load
from agoractl.cli.output import emit, stdout
from agoractl.errors import UsageError


def status(manifest: ManifestArg, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """A live summary of a running swarm from the Health Monitor's database.

    Stages (serving replicas, phases, step), nodes, samples, loss, tokens/s, FLOPs and active alerts, as the
    Health Monitor (`agoractl launch health`, or `launch swarm` with monitoring.enabled) last recorded them."""
    run = load(manifest, set_)
    from agoractl.services.health.db import open_database

    engine = open_database(run)
    from agoractl.services.health.status import summary

    s = summary(engine, run.metadata.name)
    engine.dispose()
    if not s.get("snapshots"):
        raise UsageError(f"the Health Monitor's database holds nothing yet for run {run.metadata.name}",
                         hint="start it with `agoractl launch health FILE` (or monitoring.enabled: true in "
                              "`launch swarm`), and point AGORA_DATABASE_URL at its database")
    emit(s, as_json, _render)


def _render(s: dict) -> None:
    stdout.print(f"step {s['step']}  samples {s['samples']}  loss "
                 f"{'-' if s['loss'] is None else format(s['loss'], '.4f')}  tokens/s {s['tokens_per_s']:g}  "
                 f"FLOPs {s['flops']:.3g}  (recorded {s['age_s']:g} s ago)")
    n = s["nodes"]
    stdout.print(f"nodes: {n['workers']} workers, {n['trainers']} trainers present; {n['left']} left")
    for name, st in s["stages"].items():
        phases = ", ".join(f"{k} {v}" for k, v in sorted(st.get("phases", {}).items())) or "none"
        stdout.print(f"  {name:<10} serving {st['serving']}/{st['workers']}  step {st['step']}  ({phases})")
    if s["alerts"]:
        stdout.print(f"alerts ({len(s['alerts'])}):")
        for a in s["alerts"]:
            stdout.print(f"  {a['kind']}: {a['detail']}")
    else:
        stdout.print("alerts: none")
