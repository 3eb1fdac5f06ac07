"""``agoractl ops preempt``: fault injection in a running swarm through a DHT signal (report §3.5.3.1);
``agoractl ops churn``: workers replaced on a schedule (report §3.7, :mod:`agoractl.runtime.churn`).

Attaches a temporary client node to the run's DHT, picks the workers to hit among the stage's live
worker records and writes the preemption signal (:mod:`agoractl.runtime.faults`); the targeted
workers exit at that point of their next averaging round (exit code 86).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from agoractl.cli.common import FaultPoint, JsonOpt, ManifestArg, Role, SetOpt, check_stage, load
from agoractl.cli.output import emit, note, stdout
from agoractl.errors import RuntimeFailure, UsageError

app = typer.Typer(
    help="Operate a running swarm: fault injection and churn.",
    no_args_is_help=True,
    epilog="Example:\n\n  agoractl ops preempt manifests/local-cpu.yaml --stage body-1 --count 1 --during send "
           "--role contributor",
)

STAGE_READS = 3
"""DHT reads of a stage's worker records `ops preempt` merges (an announce period apart) before it says a stage
has too few eligible workers: a client that had just joined the DHT read 3 of a stage's 4 live workers, the
one contributor missing."""

PeersOpt = Annotated[Optional[list[str]], typer.Option(
    "--initial-peers", help="Multiaddr of a DHT peer of the run (repeatable); default network.initial_peers, "
                            "then the maddrs in <local.run_dir>/swarm/status.json (written by launch swarm).",
    show_default=False)]


def run_peers(run, given: Optional[list[str]]) -> list[str]:
    """Where to join the run's DHT: --initial-peers, the manifest, or a local swarm's status file."""
    if given:
        return list(given)
    if run.network.initial_peers:
        return list(run.network.initial_peers)
    status = Path(run.local.run_dir) / "swarm" / "status.json"
    try:
        maddrs = json.loads(status.read_text()).get("maddrs") or []
    except (OSError, ValueError):
        maddrs = []
    if not maddrs:
        raise UsageError("no DHT to join: no --initial-peers, network.initial_peers is empty and "
                         f"{status} names no seed", hint="pass --initial-peers MADDR (printed by `agoractl launch dht`)")
    return list(maddrs)


@app.command(epilog="Examples:\n\n  agoractl ops preempt manifests/local-cpu.yaml --stage body-1 --count 1 "
                    "--during send --role contributor\n\n"
                    "  agoractl ops preempt manifests/local-cpu.yaml --stage head --count 1 --during reduce")
def preempt(
    manifest: ManifestArg,
    stage: Annotated[str, typer.Option(help="Stage whose workers to preempt.", show_default=False)],
    count: Annotated[int, typer.Option(help="Workers to preempt (fewer if fewer are eligible).", min=1)] = 1,
    during: Annotated[FaultPoint, typer.Option(help="send: after a worker's first chunk went out; reduce: a reducer "
                                                    "holding its first reduced chunk (operators only).")] = FaultPoint.send,
    role: Annotated[Optional[Role], typer.Option(help="Only workers of this role "
                                                      "(default: any for send, operator for reduce).",
                                                 show_default=False)] = None,
    ttl_s: Annotated[float, typer.Option("--ttl-s", help="Seconds the signal stays in the DHT.", min=1)] = 600.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed of the random choice of targets.",
                                                show_default=False)] = None,
    initial_peers: PeersOpt = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Preempt COUNT workers of a stage at a point of their next averaging round (report §3.5.3.1)."""
    from agoractl.runtime import faults

    run = load(manifest, set_)
    check_stage(run, stage)
    during, role = during.value, role.value if role else None
    if during == "reduce" and role == "contributor":
        raise UsageError("--during reduce hits reducers, and contributors never reduce", hint="use --role operator")
    if run.data_parallel.method != "sparta":
        raise UsageError(f"data_parallel.method is {run.data_parallel.method}: preemption strikes during SPARTA "
                         "averaging rounds, and this run has none")
    peers = run_peers(run, initial_peers)

    from agoractl.runtime import node
    from agoractl.runtime.records import RunRecords

    dht = node.start_dht(run, peers, client_mode=True)
    try:
        records, workers = RunRecords(dht, run.metadata.name), {}
        for read in range(STAGE_READS):  # one read of a fresh client can miss records: merged over a few
            workers.update(records.stage_workers(stage))
            candidates = faults.eligible(workers.values(), during, role)
            if len(candidates) >= count or read == STAGE_READS - 1:
                break
            time.sleep(run.workers.announce_period_s)  # every live worker announces itself this often
        if not candidates:
            roles = sorted({w.role for w in workers.values()})
            raise RuntimeFailure(f"no live worker of stage {stage} can be preempted during {during}"
                                 f"{f' with role {role}' if role else ''} ({len(workers)} live"
                                 f"{', roles ' + ', '.join(roles) if roles else ''})",
                                 hint="check the stage with the swarm's status, or change --role / --during")
        signal = faults.PreemptSignal(during=during, targets=faults.choose_targets(candidates, count, seed))
        if not faults.write_signal(dht, run.metadata.name, stage, signal, ttl_s):
            raise RuntimeFailure("the DHT refused to store the preemption signal", hint="retry; check the seed is up")
    finally:
        node.shutdown_dht(dht)
    if len(signal.targets) < count:
        note(f"only {len(signal.targets)} of the requested {count} workers are eligible")
    out = {"run": run.metadata.name, "stage": stage, "during": during, "signal": signal.id,
           "targets": signal.targets, "requested": count, "expires_in_s": ttl_s}
    emit(out, as_json, lambda r: stdout.print(
        f"preemption {r['signal']}: {len(r['targets'])} worker(s) of {r['stage']} exit during {r['during']} "
        f"in their next averaging round: {', '.join(t[-8:] for t in r['targets'])}"))


@app.command(epilog="Examples:\n\n  agoractl ops churn manifests/local-cpu.yaml --every 60 --for 1800\n\n"
                    "  agoractl ops churn manifests/local-cpu.yaml --every 20 --for 120 --count 5 --seed 0 --json\n\n"
                    "  agoractl ops churn manifests/local-cpu.yaml --every 20 --for 120 --stage head --stage body-1")
def churn(
    manifest: ManifestArg,
    every: Annotated[float, typer.Option("--every", help="Seconds between replacements.", min=1)],
    for_: Annotated[float, typer.Option("--for", help="Seconds of churn in all (then it ends).", min=1)],
    count: Annotated[Optional[int], typer.Option(help="At most this many replacements.", min=1,
                                                 show_default=False)] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed of the random choice of workers.",
                                                show_default=False)] = None,
    stage: Annotated[Optional[list[str]], typer.Option(help="Only replace workers of this stage (repeat the option "
                                                            "for several; default: any).",
                                                       show_default=False)] = None,
    answer_timeout_s: Annotated[float, typer.Option("--answer-timeout-s", min=1,
                                                    help="Seconds to wait for the launcher to carry out a "
                                                         "replacement.")] = 120.0,
    start_timeout_s: Annotated[float, typer.Option("--start-timeout-s", min=1,
                                                   help="Seconds to wait for the swarm to start training.")] = 900.0,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Churn a swarm that `launch swarm` runs: every EVERY seconds for FOR seconds, SIGKILL a random live worker
    (never the last of its stage) and start a new one for its stage through the ordinary join path (report
    §3.7). One line per event (a JSON object per line with --json); the swarm's report lists them too."""
    import random
    import time

    from agoractl.runtime import churn as churning

    run = load(manifest, set_)
    stages = set(stage or ())
    for name in sorted(stages):
        check_stage(run, name)
    status_file = Path(run.local.run_dir) / "swarm" / "status.json"
    rng = random.Random(seed)
    # The schedule starts once the swarm trains (its launcher carries out requests only then).
    if not churning.wait_training(status_file, start_timeout_s):
        raise RuntimeFailure(f"no swarm trained within {start_timeout_s:.0f} s: {status_file} shows no step",
                             hint="start the run with `agoractl launch swarm FILE` (same local.run_dir)")
    start, done = time.monotonic(), []

    def log(event: dict) -> None:
        if as_json:  # JSON lines: one object per event, as it happens
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()
        else:
            note(f"churn: {event.get('event')}: " + ", ".join(f"{k}={v}" for k, v in event.items() if k != "event"))

    for offset in churning.schedule(every, for_, count):
        # The schedule itself (one replacement every --every seconds), cut short when the swarm's launcher ends.
        while time.monotonic() < start + offset and churning.launcher_alive(churning.read_status(status_file)):
            time.sleep(min(0.5, max(0.0, start + offset - time.monotonic())))
        status = churning.read_status(status_file)
        if not churning.launcher_alive(status):
            log({"event": "swarm ended", "t_s": round(time.monotonic() - start, 1)})
            break
        live = churning.live_workers(status)
        target = churning.pick([w for w in live if not stages or w.get("stage") in stages], rng)
        if target is None:
            log({"event": "skipped", "t_s": round(time.monotonic() - start, 1),
                 "why": "no stage has two serving workers (a newcomer still joining, or the swarm ended)"})
            continue
        answer = churning.request(Path(run.local.run_dir), target["name"], answer_timeout_s, status_file)
        if answer is None and not churning.launcher_alive(churning.read_status(status_file)):
            log({"event": "swarm ended", "t_s": round(time.monotonic() - start, 1)})
            break
        if answer is None:
            raise RuntimeFailure(f"the launcher did not answer the replacement of {target['name']} within "
                                 f"{answer_timeout_s:.0f} s", hint="is `launch swarm` still running? see its output")
        event = {"event": "replaced" if "killed" in answer else "refused", "t_s": round(time.monotonic() - start, 1),
                 **{k: v for k, v in answer.items() if k != "joined_s"}}
        log(event)
        done.append(event)
    summary = {"event": "summary", "replaced": sum(e["event"] == "replaced" for e in done), "requests": len(done),
               "elapsed_s": round(time.monotonic() - start, 1)}
    log(summary)
