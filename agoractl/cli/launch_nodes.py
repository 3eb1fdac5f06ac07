"""``agoractl launch dht|worker|trainer|swarm``: the nodes of a decentralized run, one at a time or as
a whole local swarm. Registered on the ``launch`` group (:mod:`agoractl.cli.launch`). Thin: parse,
call the runtime, render."""

from __future__ import annotations

import sys
import threading
import time
from typing import Annotated, Optional

import typer
from rich.live import Live
from rich.table import Table

from agoractl import logs

from agoractl.cli.common import (JsonOpt, ManifestArg, Role, RoleOpt, SetOpt, check_device, check_stage, load,
                                 require_cuda)
from agoractl.cli.launch import FreshOpt, ForceOpt, ResumeStepOpt, UntilStepOpt, app, check_resume_options
from agoractl.cli.launch_authorizer import loopback_authorizer
from agoractl.cli.output import emit, note, stderr, stdout
from agoractl.errors import UsageError
from agoractl.training.fault_drill import FAULTS
from agoractl.ops import resume

PeersOpt = Annotated[Optional[list[str]], typer.Option(
    "--initial-peers", help="Multiaddr of a DHT peer to join (repeatable); default network.initial_peers.",
    show_default=False)]
StatsOpt = Annotated[Optional[str], typer.Option(
    "--stats", help="Write the node's final statistics here as JSON when it exits.", show_default=False)]


def _threads(run) -> None:
    import torch

    torch.set_num_threads(run.local.threads_per_process)


@app.command(epilog="Example:\n\n  agoractl launch dht manifests/local-cpu.yaml")
def dht(manifest: ManifestArg, set_: SetOpt = None, initial_peers: PeersOpt = None, as_json: JsonOpt = False) -> None:
    """A DHT seed node: prints the multiaddrs others join with (--initial-peers), then serves until
    Ctrl-C or SIGTERM."""
    from agoractl.runtime import node

    run = load(manifest, set_)
    d = node.start_dht(run, initial_peers or run.network.initial_peers)
    stop = threading.Event()
    node.stop_on_signals(stop)
    node.watch_parent(stop)
    try:
        maddrs = node.visible_maddrs(d)
        emit({"run": run.metadata.name, "peer": d.peer_id.to_base58(), "maddrs": maddrs}, as_json,
             lambda r: [stdout.print(m) for m in r["maddrs"]])
        note(f"DHT seed of run {run.metadata.name} is up; join with --initial-peers {maddrs[0] if maddrs else ''}")
        while not stop.wait(1.0):
            pass
    finally:
        node.shutdown_dht(d)


@app.command(epilog="Example:\n\n  agoractl launch worker manifests/local-cpu.yaml --stage auto "
                    "--initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEER")
def worker(
    manifest: ManifestArg,
    stage: Annotated[str, typer.Option(help="Stage to serve: a stage name, or auto (the fewest live replicas).")],
    set_: SetOpt = None,
    initial_peers: PeersOpt = None,
    role: RoleOpt = Role.operator,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N (master weights and AdamW moments stay on the "
                                             "CPU).")] = "cpu",
    stats: StatsOpt = None,
    fault: Annotated[Optional[str], typer.Option(
        hidden=True, help="Fault drill: nan-outputs, huge-outputs, nan-grads, nan-parts or huge-parts "
                          "(this worker's values are made wrong on purpose; for tests of the swarm's defences).",
        show_default=False)] = None,
    resume_step: ResumeStepOpt = None,
    fresh: FreshOpt = False,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """One worker: a replica of one stage, serving forward and backward requests (report §3.3.1) until the
    stage reaches training.max_steps and falls idle, or Ctrl-C / SIGTERM. A worker of a stage that is not
    running resumes from the newest checkpoint complete for every stage (or --resume-step); one joining
    a running stage loads its state from a peer or the store."""
    run = load(manifest, set_)
    check_resume_options(resume_step, fresh)
    # Checked before importing the runtime (hivemind and torch take seconds to import).
    check_stage(run, stage, allow_auto=True)
    check_device(device)
    if fault is not None and fault not in FAULTS:
        raise UsageError(f"--fault {fault}: choose one of {', '.join(FAULTS)}")
    from agoractl.runtime import node

    node.require_peers(initial_peers or run.network.initial_peers, "worker")
    require_cuda(device)
    from agoractl.runtime.worker_node import WorkerNode

    _threads(run)
    result = WorkerNode(run, stage, initial_peers or run.network.initial_peers, role=role.value, device=device,
                        stats_path=stats, fault=fault, resume_step=resume_step, fresh=fresh,
                        force=force).serve()
    emit({k: result[k] for k in ("stage", "peer", "step", "forward_samples", "backward_samples", "max_coalesced")},
         as_json, lambda r: stdout.print(f"worker of {r['stage']}: step {r['step']}, {r['backward_samples']} "
                                         f"samples, coalesced up to {r['max_coalesced']}"))
    if result.get("termination"):
        _self_terminated(result["termination"])


def _check_store(run, resume_step, fresh: bool, force: bool):
    """The store's refusals (another run's checkpoints, a missing step), before hivemind is imported."""
    return resume.plan(run, resume_step=resume_step, fresh=fresh, force=force, apply=False)


def _self_terminated(termination: dict) -> None:
    """One final log line naming the rule, then the rule's exit code (report §3.3.1.6)."""
    logs.get("worker").error("self-termination", rule=termination["rule"], exit_code=termination["exit_code"],
                             message=termination["message"])
    raise typer.Exit(termination["exit_code"])


@app.command(epilog="Example:\n\n  agoractl launch trainer manifests/local-cpu.yaml --index 0 "
                    "--initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEER")
def trainer(
    manifest: ManifestArg,
    set_: SetOpt = None,
    index: Annotated[int, typer.Option(help="This trainer's index in the shard ledger (0-based).", min=0)] = 0,
    initial_peers: PeersOpt = None,
    min_workers: Annotated[int, typer.Option(help="Start once every stage has this many live workers.",
                                             min=1)] = 1,
    stats: StatsOpt = None,
    resume_step: ResumeStepOpt = None,
    fresh: FreshOpt = False,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """One trainer: streams its shards and walks every sample through the pipeline (report §3.3.2) until
    every stage reached training.max_steps, its data runs out, or Ctrl-C / SIGTERM. It reads on from its
    data position at the step the run resumes from (the newest complete checkpoint, or --resume-step)."""
    from agoractl.runtime.trainer import Trainer

    run = load(manifest, set_)
    check_resume_options(resume_step, fresh)
    plan = _check_store(run, resume_step, fresh, force)
    if run.workers.self_feed:
        raise UsageError("workers.self_feed is on: the whole-model replicas read their own samples, a trainer has "
                         "nothing to feed", hint="launch workers only, or --set workers.self_feed=false")
    if index >= run.trainers.count:
        raise UsageError(f"--index {index}: the ledger has trainers.count = {run.trainers.count} trainers",
                         hint="use an index below trainers.count, or raise trainers.count")
    _threads(run)
    from agoractl.training.data_resume import CheckpointPositions

    positions = CheckpointPositions(run, index, plan.binding)
    result = Trainer(run, index, initial_peers or run.network.initial_peers, stats_path=stats,
                     min_workers=min_workers, positions=positions, resume_step=plan.step).train()
    result["end_reason"] = result["finished_reason"]
    note(f"trainer {index} ended: {result['end_reason']}")
    emit({k: result[k] for k in ("trainer", "dispatched", "completed", "lost", "finished_reason", "end_reason")},
         as_json, lambda r: stdout.print(f"trainer {r['trainer']}: {r['completed']} samples completed, {r['lost']} "
                                         f"lost ({r['finished_reason']})"))
    _trainer_exit(index, result["finished_reason"])


def _trainer_exit(index: int, reason: str) -> None:
    """0 when max_steps was reached or the data ran out (data.epochs read); 128 + the signal when stopped by
    one; 1 when it ended early for another reason (a stall raised StalledRun already: 3)."""
    import signal

    from agoractl.errors import Interrupted, RuntimeFailure

    from agoractl.training.node_stats import FINISHED_REASONS

    if reason in FINISHED_REASONS or reason.startswith("data exhausted"):
        return
    if reason.startswith("interrupted by SIG"):
        raise Interrupted(int(signal.Signals[reason.split()[-1]]), f"trainer {index}: {reason}")
    raise RuntimeFailure(f"trainer {index} ended before training.max_steps: {reason}", hint="see its log")


@app.command(epilog="Examples:\n\n  agoractl launch swarm manifests/local-cpu.yaml\n\n"
                    "  agoractl launch swarm manifests/local-cpu.yaml --set local.workers_per_stage=2 --json")
def swarm(manifest: ManifestArg, set_: SetOpt = None, resume_step: ResumeStepOpt = None, fresh: FreshOpt = False,
          force: ForceOpt = False, until_step: UntilStepOpt = None,
          device: Annotated[str, typer.Option(help="Every worker's device: cpu, cuda or cuda:N (all of them on it; "
                                                   "trainers hold no weights and stay on the CPU).")] = "cpu",
          as_json: JsonOpt = False) -> None:
    """A whole run on this machine: a DHT seed, local.workers_per_stage workers per stage and local.trainers
    trainers, each its own process on loopback. A worker or trainer that exits is started again (up to
    local.max_restarts times); a run without a step for local.stall_timeout_s ends with exit code 3. Shows
    live progress on a terminal, stops every process on exit, error, Ctrl-C (exit 130) or SIGTERM (143),
    and writes <local.run_dir>/swarm-report.json. Given a store holding this run's checkpoints, it resumes
    from the newest step complete for every stage (or --resume-step): weights, optimizer state, step and
    schedule, SPARTA round / FGDiLoCo outer state, trainers' data positions. With --until-step N it stops
    after step N (checkpointed there) on the schedule of training.max_steps: the same command without it
    then continues the run."""
    from agoractl.runtime.swarm import Swarm

    if until_step is not None:  # every node reads it from the manifest overrides
        set_ = [*(set_ or []), f"training.until_step={until_step}"]
    run = load(manifest, set_)
    check_resume_options(resume_step, fresh)
    check_device(device)
    _check_store(run, resume_step, fresh, force)  # refusals before anything starts
    require_cuda(device)
    if run.model.family == "llama" and run.model.ssn.rank is None and len(run.stages) > 1:
        note("note: model.ssn.rank is null: d-wide activations cross every stage boundary")

    if run.local.hosts.enabled:
        from agoractl.runtime.hosts import check_available

        check_available()  # root, ip and tc: a usage error before anything starts
        if run.admission.enabled and run.admission.authorizer is None:
            raise UsageError("local.hosts with admission on needs admission.authorizer: the Authorizer that launch "
                             "swarm would start listens on loopback, which no emulated host reaches",
                             hint="start `agoractl launch authorizer` on an address the hosts reach, or set "
                                  "local.hosts.enabled=false")
    run, set_, authorizer = loopback_authorizer(run, manifest, set_)  # admission on, no URL: one on loopback
    stack, utility = None, ()
    if run.monitoring.enabled:
        from agoractl.services.dashboard import swarm as dashboard
        from agoractl.services.health import stack as monitoring  # prometheus, fastapi: only when asked for

        try:
            if run.dashboard.enabled:
                dashboard.check_port(run)  # taken: one line before anything starts
            stack, set_ = monitoring.for_swarm(run, set_, note)
            utility = ("health",)
            if run.dashboard.enabled:  # a utility node too: on the monitor's database and this Prometheus
                set_, utility = dashboard.for_swarm(run, set_, stack.prometheus_url, note), (*utility, dashboard.KIND)
        except BaseException:
            if stack is not None:
                stack.stop()
            if authorizer is not None:
                authorizer.stop()
            raise
        run = load(manifest, set_)
    note(f"swarm: {run.metadata.name}, {len(run.stages)} stages x {run.local.workers_per_stage} workers, "
         f"{run.local.trainers} trainers, {run.training.max_steps} steps of {run.training.global_batch_size} samples")
    with _Progress(run, live=sys.stderr.isatty() and not as_json) as progress:
        try:
            report = Swarm(run, manifest, set_ or [], on_progress=progress.update, on_note=note,
                           resume=(resume_step, fresh, force), utility=utility, device=device).run_swarm()
        finally:
            if authorizer is not None:
                authorizer.stop()
            if stack is not None:
                stack.stop()
    note(f"swarm ended: {report['end_reason']} (exit code 0)")
    emit(report, as_json, _render_swarm)


class _Progress:
    """Live progress on a terminal (rich), or a line on stderr every few seconds otherwise."""

    EVERY_S = 5.0

    def __init__(self, run, live: bool):
        self.run, self.live = run, live
        self._live = None
        self._last = 0.0

    def __enter__(self):
        if self.live:
            self._live = Live(console=stderr, refresh_per_second=2, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self, status: dict) -> None:
        loss = "-" if status["loss"] is None else f"{status['loss']:.4f}"
        workers = " ".join(f"{s}:{v['live']}" for s, v in status["stages"].items())
        line = (f"step {status['step']}/{status['max_steps']}  loss {loss}  "
                f"{status['tokens_per_s']:,.0f} tok/s  workers {workers}  "
                f"samples {status['completed_samples']} (lost {status['lost_samples']})")
        if self._live is not None:
            table = Table(title=line, show_edge=False)
            for col in ("stage", "live workers", "step", "samples", "max coalesced"):
                table.add_column(col, justify="right" if col != "stage" else "left")
            for s, v in status["stages"].items():
                table.add_row(s, str(v["live"]), str(v["step"]), str(v["samples"]), str(v["max_coalesced"]))
            self._live.update(table)
        elif time.monotonic() - self._last >= self.EVERY_S:
            self._last = time.monotonic()
            note(line)


def _render_swarm(r: dict) -> None:
    if (r.get("resume") or {}).get("action") == "resume":
        stdout.print(f"resumed from step {r['resume']['step']} ({r['resume']['store']})")
    first = r["loss"][0][1] if r["loss"] else float("nan")
    final = r["final_loss"] if r["final_loss"] is not None else float("nan")
    stdout.print(f"{r['name']}: {r['steps']} steps, {r['tokens']:,} tokens in {r['elapsed_s']:.1f} s "
                 f"({r['tokens_per_s']:,.0f} tokens/s); loss {first:.4f} -> {final:.4f}; "
                 f"{r['samples_lost']} samples lost")
    table = Table(show_edge=False)
    keys = set().union(*(s for s in r["stages"])) if r["stages"] else set()
    health = next((cols for cols in _AVERAGING_COLUMNS.values() if cols[0][1] in keys), ())
    for col in ("stage", "workers seen", "steps", "samples", "max coalesced", "retries", "bans", "bwd fallbacks",
                *(title for title, _ in health)):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in r["stages"]:
        table.add_row(s["name"], str(s["workers_seen"]), str(s["steps"]), str(s["samples"]), str(s["max_coalesced"]),
                      str(s["retries"]), str(s["bans"]), str(s["backward_fallbacks"]),
                      *(_cell(s.get(key)) for _, key in health))
    stdout.print(table)
    for peer, f in (r.get("faults") or {}).items():  # workers whose replies trainers rejected (and banned)
        counts = ", ".join(f"{k} {v}" for k, v in f.items() if k not in ("stage", "trainers"))
        stdout.print(f"faulty worker {peer[-8:]} of {f.get('stage')}: rejected by {f.get('trainers')} trainer(s) "
                     f"({counts})")
    stdout.print(f"end: {r.get('end_reason', 'unknown')}")
    stdout.print(f"report: {r['report_path']}")


_AVERAGING_COLUMNS = {  # the stage report's keys, by data_parallel.method
    "sparta": (("avg rounds", "averaging_rounds"), ("avg success", "averaging_success_mean"),
               ("failed rounds", "rounds_failed")),
    "fgdiloco": (("outer rounds", "outer_rounds"), ("mix1 success", "mix1_success_mean"),
                 ("mix2 success", "mix2_success_mean")),
}
"""The averaging health a swarm's summary shows per stage (report §5.7.1): SPARTA rounds, or FGDiLoCo's
outer rounds and the success of its two mixes."""


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.0%}" if isinstance(value, float) else str(value)
