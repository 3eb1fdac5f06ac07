"""``agoractl analyze divergence``: how far a stage's replicas drifted apart, from their snapshots.

Reads ``<checkpoints.store>/snapshots/<stage>/step-N/*.safetensors`` directly (see
:mod:`agoractl.ops.analyze`); prints a table per snapshot step, or with ``--json`` one object with
``stage``, ``steps``, ``segment_variance``, ``consensus_movement``, ``l2_mean``, ``js_mean``,
``js_max`` (and more); ``--plot out.png`` draws the report's figures 28-29 for the stage. Runs on
``local.threads_per_process`` torch threads, as ``launch`` and ``simulate`` do.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from agoractl.cli.common import JsonOpt, ManifestArg, SetOpt, check_device, load, stage_index
from agoractl.cli.output import emit, note, stdout
from agoractl.errors import UsageError

app = typer.Typer(
    help="Analyse a run's outputs: inter-replica divergence from replica snapshots.",
    no_args_is_help=True,
    epilog="Examples:\n\n  agoractl analyze divergence manifests/local-cpu.yaml --stage head --plot head.png\n\n"
           "  agoractl analyze divergence manifests/local-cpu.yaml --stage body-1 --steps 100:400 --json",
)


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3e}"


@app.command()
def divergence(
    file: ManifestArg,
    stage: Annotated[str, typer.Option("--stage", help="Stage to analyse.", show_default=False)],
    steps: Annotated[Optional[str], typer.Option(
        "--steps", help="Snapshot steps: comma-separated steps and inclusive ranges A:B; default all.",
        show_default=False)] = None,
    probe: Annotated[Optional[str], typer.Option(
        "--probe", help="Probe text for the JS distance: a parquet file (data.text_column) or a UTF-8 text "
                        "file; default the run's first shard sequences, else seeded random tokens.",
        show_default=False)] = None,
    probe_batch: Annotated[int, typer.Option("--probe-batch", help="Sequences in the probe batch.")] = 8,
    js: Annotated[bool, typer.Option("--js/--no-js", help="Compute the JS distance (runs the model).")] = True,
    device: Annotated[str, typer.Option("--device", help="Torch device for the JS evaluation: cpu, cuda or cuda:N.")] = "cpu",
    plot: Annotated[Optional[str], typer.Option("--plot", help="Write figures 28-29 of the stage to this PNG.",
                                                show_default=False)] = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Per-segment inter-replica variance, consensus movement, pairwise L2 and JS distance per step."""
    run = load(file, set_)
    stage_index(run, stage)
    check_device(device)
    if plot and not plot.lower().endswith(".png"):
        raise UsageError(f"--plot {plot}: the plot is a PNG; give a path ending in .png")
    import torch

    from agoractl.ops.analyze import analyze_divergence  # torch: after the usage checks

    # torch threads as every other command (local.threads_per_process): the default, one per core, made
    # the JS pass 5x slower in wall time on a busy 2-core machine (the threads wait on each other).
    torch.set_num_threads(run.local.threads_per_process)
    result = analyze_divergence(run, stage, steps=steps, probe=probe, probe_batch=probe_batch, js=js,
                                device=device, progress=None if as_json else note)
    if plot:
        from agoractl.ops.divergence_plot import plot_divergence

        result["plot"] = plot_divergence(result, plot)
        if not as_json:
            note(f"wrote {plot}")
    emit(result, as_json, _render)


def _render(r: dict) -> None:
    t = Table(title=f"divergence of stage {r['stage']} ({r['segments']} SPARTA segments, "
                    f"{r['parameters']:,} parameters)")
    for col in ("step", "replicas", "variance", "lowest segment", "highest segment", "movement",
                "L2 mean", "JS mean", "JS max"):
        t.add_column(col, justify="right")
    for step in map(str, r["steps"]):
        seg = [(v, i) for i, v in enumerate(r["segment_variance"][step]) if v is not None]
        lo, hi = min(seg), max(seg)
        t.add_row(step, str(len(r["replicas"][step])), _fmt(r["variance"][step]), f"{lo[1]} ({lo[0]:.2e})",
                  f"{hi[1]} ({hi[0]:.2e})", _fmt(r["consensus_movement"][step]), _fmt(r["l2_mean"][step]),
                  _fmt(r["js_mean"][step]), _fmt(r["js_max"][step]))
    stdout.print(t)
    if r.get("probe"):
        p = r["probe"]
        stdout.print(f"JS probe: {p['kind']} ({p['sequences']} x {p['tokens']} tokens)"
                     + (f"; {p['reason']}" if p.get("reason") else ""))
        contexts = {how for ctx in r["js_context"].values() for how in ctx.values()}
        if any(c.startswith("initialisation") for c in contexts):
            stdout.print("note: some stages had neither snapshots nor checkpoints; they were set to their "
                         "initialisation for the JS evaluation (see js_context in --json)")
