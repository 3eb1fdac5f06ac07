"""``agoractl simulate FILE --scenario NAME``: the documents' ablations with in-process replicas.

Thin: parse and check options, call :mod:`agoractl.sim.scenarios`, render a table or JSON, and
optionally write a plot (:mod:`agoractl.cli.simulate_plot`). Torch is imported only when a scenario
runs, so ``--help`` stays fast.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from agoractl.cli.common import GlobalMixing, JsonOpt, ManifestArg, Scenario, SetOpt, SimData, load
from agoractl.cli.output import emit, note, stdout
from agoractl.cli.simulate_plot import write_plot
from agoractl.errors import UsageError

FG, SP = "FGDiLoCo scenario", "SPARTA scenarios"


def _floats(text: str, option: str, lo: float, hi: float) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{option}: expected comma-separated numbers; got {text!r}") from None
    bad = [v for v in values if not lo < v <= hi]
    if not values or bad:
        raise UsageError(f"{option}: every value must be in ({lo:g}, {hi:g}]; got {text!r}")
    return values


def _positive(value: int, option: str, minimum: int = 1) -> None:
    if value < minimum:
        raise UsageError(f"{option} must be at least {minimum}; got {value}")


def simulate(
    file: ManifestArg,
    scenario: Annotated[Scenario, typer.Option(help="The ablation to run.", show_default=False)],
    set_: SetOpt = None,
    as_json: JsonOpt = False,
    plot: Annotated[Optional[Path], typer.Option(help="Write a PNG plot of the curves here.")] = None,
    replicas: Annotated[int, typer.Option(help="Replicas (FGDiLoCo: full models; SPARTA: per stage).")] = 4,
    data: Annotated[SimData, typer.Option(
        help="auto: the run's shards if <data.output>/index.json exists, else synthetic lesson text in memory; "
             "shards; synthetic.")] = SimData.auto,
    probe_samples: Annotated[int, typer.Option(help="Held-out samples for eval loss and JS distance.")] = 16,
    seed: Annotated[int, typer.Option(help="Seed of data order, routing, matchings and failures.")] = 0,
    rounds: Annotated[int, typer.Option(help="Outer rounds per variant.", rich_help_panel=FG)] = 15,
    inner_steps: Annotated[Optional[int], typer.Option(
        help="H, inner steps per round; default data_parallel.fgdiloco.inner_steps.", rich_help_panel=FG)] = None,
    batch: Annotated[Optional[int], typer.Option(
        help="Samples per replica per inner step; default global_batch_size / replicas.", rich_help_panel=FG)] = None,
    variants: Annotated[str, typer.Option(help="Comma-separated FGDiLoCo variants.", rich_help_panel=FG)] =
        "diloco,global_m1,global_m1_local_m2,local_m1_m2",
    bandwidth: Annotated[Optional[list[float]], typer.Option(
        help="Link bandwidth in Mbit/s (repeatable); default 100 and 200.", rich_help_panel=FG)] = None,
    latency_ms: Annotated[Optional[float], typer.Option(
        help="One-way latency in ms; default admission.max_latency_ms.", rich_help_panel=FG)] = None,
    payload_params: Annotated[str, typer.Option(
        help="Parameters in each mixing payload for the time model: a number (default the seed's 1.5B) or "
             "'model' (the simulated model's own size).", rich_help_panel=FG)] = "1.5e9",
    bytes_per_param: Annotated[int, typer.Option(help="Bytes per parameter on the wire.", rich_help_panel=FG)] = 4,
    step_time_s: Annotated[str, typer.Option(
        help="Compute seconds per inner step in the time model: a number, 'seed' (calibrated to the seed's "
             "29 vs 16 weeks for DiLoCo vs GlobalM1 at 200 Mbit/s, M=8, H=100) or 'measured' (this machine, "
             "simulated model and replicas).", rich_help_panel=FG)] = "seed",
    global_mixing: Annotated[GlobalMixing, typer.Option(
        help="Cost of a global mixing in the time model: all-to-all (the seed's gossip accounting, an exchange "
             "with each of the M-1 others) or butterfly (bandwidth-optimal all-reduce, 2(M-1)/M payloads).",
        rich_help_panel=FG)] = GlobalMixing.all_to_all,
    time_inner_steps: Annotated[int, typer.Option(
        help="Inner steps one simulated round stands for in the time model (the seed's H); ignored with "
             "--step-time-s measured.", rich_help_panel=FG)] = 100,
    steps: Annotated[int, typer.Option(help="sparta-backward: steps per variant.", rich_help_panel=SP)] = 150,
    microbatch: Annotated[int, typer.Option(help="Samples per routed microbatch.", rich_help_panel=SP)] = 4,
    lag_steps: Annotated[int, typer.Option(
        help="Steps between an averaging round's snapshot and its applied result.", rich_help_panel=SP)] = 1,
    participation: Annotated[str, typer.Option(
        help="sparta-participation: comma-separated participation levels in (0, 1].", rich_help_panel=SP)] =
        "1.0,0.9,0.75,0.5",
    warmup_steps: Annotated[int, typer.Option(help="sparta-participation: clean steps before failures.",
                                              rich_help_panel=SP)] = 20,
    failure_steps: Annotated[int, typer.Option(help="sparta-participation: steps with injected failures.",
                                               rich_help_panel=SP)] = 50,
    recovery_steps: Annotated[int, typer.Option(help="sparta-participation: clean steps after failures.",
                                                rich_help_panel=SP)] = 30,
) -> None:
    """Train replicas in this process with the workers' own algorithm code and compare the variants.

    Examples:

      agoractl simulate manifests/local-cpu.yaml --scenario fgdiloco --rounds 6 --inner-steps 5 --json

      agoractl simulate manifests/local-cpu.yaml --scenario sparta-backward --plot backward.png
    """
    scenario, data, global_mixing = scenario.value, data.value, global_mixing.value
    run = load(file, set_)
    _positive(replicas, "--replicas", 2)
    _positive(probe_samples, "--probe-samples")
    for value, option in ((rounds, "--rounds"), (steps, "--steps"), (microbatch, "--microbatch"),
                          (bytes_per_param, "--bytes-per-param"), (time_inner_steps, "--time-inner-steps")):
        _positive(value, option)
    if plot is not None and plot.suffix.lower() != ".png":
        raise UsageError(f"--plot: {plot} must end in .png")
    if plot is not None and not plot.resolve().parent.is_dir():
        raise UsageError(f"--plot: directory {plot.resolve().parent} does not exist")

    import torch

    from agoractl.sim import scenarios

    torch.set_num_threads(run.local.threads_per_process)
    common = dict(replicas=replicas, data=data, probe_samples=probe_samples, seed=seed, progress=note)
    t0 = time.perf_counter()
    if scenario == "fgdiloco":
        names = [v.strip() for v in variants.split(",") if v.strip()]
        unknown = [v for v in names if v not in scenarios.VARIANTS]
        if not names or unknown:
            raise UsageError(f"--variants: unknown {', '.join(unknown) or '(none given)'}; "
                             f"one of {', '.join(scenarios.VARIANTS)}")
        for value, option in ((inner_steps, "--inner-steps"), (batch, "--batch")):
            if value is not None:
                _positive(value, option)
        bws = bandwidth or [100.0, 200.0]
        if any(b <= 0 for b in bws):
            raise UsageError(f"--bandwidth must be positive Mbit/s; got {bws}")
        if latency_ms is not None and latency_ms < 0:
            raise UsageError(f"--latency-ms must be non-negative; got {latency_ms}")
        payload = None if payload_params == "model" else _floats(payload_params, "--payload-params", 0, float("inf"))[0]
        step_time = (None if step_time_s == "measured" else step_time_s if step_time_s == "seed" else
                     _floats(step_time_s, "--step-time-s", 0, float("inf"))[0])
        result = scenarios.fgdiloco(run, variants=names, rounds=rounds, inner_steps=inner_steps, batch=batch,
                                    bandwidths_mbps=bws, latency_ms=latency_ms, payload_params=payload,
                                    bytes_per_param=bytes_per_param, step_time_s=step_time,
                                    time_inner_steps=time_inner_steps, global_mixing=global_mixing, **common)
    elif scenario == "sparta-backward":
        result = scenarios.sparta_backward(run, steps=steps, microbatch=microbatch, lag_steps=lag_steps, **common)
    else:
        for value, option in ((warmup_steps, "--warmup-steps"), (failure_steps, "--failure-steps"),
                              (recovery_steps, "--recovery-steps")):
            _positive(value, option)
        levels = _floats(participation, "--participation", 0, 1)
        result = scenarios.sparta_participation(run, levels=levels, warmup_steps=warmup_steps,
                                                failure_steps=failure_steps, recovery_steps=recovery_steps,
                                                microbatch=microbatch, lag_steps=lag_steps, **common)
    result["manifest"] = str(file)
    if plot is not None:
        result["plot"] = str(write_plot(result, plot))
    note(f"simulate {scenario}: done in {time.perf_counter() - t0:.1f} s")
    emit(result, as_json, _render)


def _render(result: dict) -> None:
    scenario = result["scenario"]
    table = Table(title=f"simulate {scenario} ({result['data']})")
    table.add_column("variant")
    table.add_column("final loss", justify="right")
    if scenario == "fgdiloco":
        bws = [f"{b:g}" for b in result["bandwidths_mbps"]]
        for b in bws:
            table.add_column(f"util @{b}", justify="right")
        for b in bws:
            table.add_column(f"h to DiLoCo @{b}", justify="right")
        for col in ("JS mean", "JS max", "L2 mean"):
            table.add_column(col, justify="right")
        for name, v in result["variants"].items():
            hours = [v["hours_to_diloco_final"][b] for b in bws]
            table.add_row(name, f"{v['final_loss']:.4f}", *[f"{v['utilization'][b]:.0%}" for b in bws],
                          *["-" if h is None else f"{h:.2f}" for h in hours],
                          f"{v['js_mean']:.4f}", f"{v['js_max']:.4f}", f"{v['l2_mean']:.3f}")
    elif scenario == "sparta-backward":
        for name, v in result["variants"].items():
            table.add_row(name, f"{v['final_loss']:.4f}")
    else:
        for col in ("participation", "loss at failure end", "gap at failure end", "gap at end"):
            table.add_column(col, justify="right")
        for name, v in result["variants"].items():
            table.add_row(name, f"{v['final_loss']:.4f}", f"{v['participation_failure_phase']:.0%}",
                          f"{v['loss_failure_end']:.4f}", f"{v.get('gap_failure_end', 0):+.4f}",
                          f"{v.get('gap_end', 0):+.4f}")
    stdout.print(table)
    if "plot" in result:
        stdout.print(f"plot: {result['plot']}")
