"""``agoractl manifest validate|schema|plan``: check a run manifest and show what it costs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from agoractl.cli.common import ArParams, JsonOpt, ManifestArg, SetOpt, load
from agoractl.cli.output import emit, human_bytes, human_count, human_rate, stdout
from agoractl.errors import UsageError
from agoractl.manifest.loader import ManifestError, Problem
from agoractl.manifest.plan import make_plan
from agoractl.manifest.schema import Run

app = typer.Typer(
    help="Validate a run manifest, print its JSON Schema, or plan what it costs.",
    no_args_is_help=True,
    epilog="Examples:\n\n  agoractl manifest validate manifests/*.yaml\n\n"
           "  agoractl manifest plan manifests/pluralis-8b.yaml --json",
)


@app.command()
def validate(
    files: Annotated[list[Path], typer.Argument(help="Manifest files.", show_default=False)],
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Validate manifests; every problem is listed at once with its dotted path and file:line."""
    results, problems = [], []
    for f in files:
        try:
            load(f, set_)
            results.append({"file": str(f), "valid": True, "problems": []})
        except ManifestError as e:
            problems.extend(e.problems)
            results.append({"file": str(f), "valid": False,
                            "problems": [p.__dict__ for p in e.problems]})
        except UsageError as e:  # the file itself: missing, binary, empty
            if len(files) == 1 and not as_json:
                raise  # one line and its hint
            message = e.message.removeprefix(f"{f}: ")
            problems.append(Problem("<file>", message, str(f)))
            results.append({"file": str(f), "valid": False,
                            "problems": [{"path": "<file>", "message": message, "location": str(f)}]})
    if as_json:
        emit({"files": results, "valid": not problems}, True)
    else:
        for r in results:
            if r["valid"]:
                stdout.print(f"ok {r['file']}")
    if problems:
        raise ManifestError(f"{len([r for r in results if not r['valid']])} of {len(files)} manifest(s)", problems)


@app.command()
def schema() -> None:
    """Print the JSON Schema of the run manifest (for editors and docs)."""
    print(json.dumps(Run.model_json_schema(), indent=2))


@app.command()
def plan(
    file: ManifestArg,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
    a_f: Annotated[float, typer.Option(help="Forward activation payloads per second (report §3.5.2.1).")] = 3.0,
    a_b: Annotated[float, typer.Option(help="Backward activation payloads per second.")] = 3.0,
    ar_time: Annotated[float, typer.Option(help="Seconds an all-reduce round may take.")] = 10.0,
    ar_params: Annotated[ArParams, typer.Option(
        help="Parameters in the all-reduce payload: dense (the report's worst case) or trainable.")] = ArParams.dense,
) -> None:
    """Stages, parameters, memory per worker, boundary bytes, SPARTA payload, bandwidth per node."""
    run = load(file, set_)
    emit(make_plan(run, a_f, a_b, ar_time, ar_params.value), as_json, _render)


def _render(p: dict) -> None:
    t = Table(title=f"plan: {p['name']} ({p['family']})")
    for col in ("stage", "role", "blocks", "trainable", "dense-equiv.", "worker memory", "SPARTA/round",
                "bf16 Mbit/s", "fp32 Mbit/s"):
        t.add_column(col, justify="left" if col in ("stage", "role") else "right")
    for s in p["stages"]:
        bw = s["required_bandwidth_mbps"]
        t.add_row(s["name"], s["role"], f"{s['layers'][0]}-{s['layers'][1] - 1}", human_count(s["params"]),
                  human_count(s["dense_params"]), human_bytes(s["memory_bytes"]),
                  human_bytes(s["sparta_bytes_per_round"]), human_rate(bw["bf16"]), human_rate(bw["fp32"]))
    t.add_row("total", "", "", human_count(p["params"]), human_count(p["dense_params"]), "", 
              human_bytes(p["sparta_bytes_per_round"]), "", "")
    stdout.print(t)
    b = p["boundary_bytes_per_token"]
    if len(p["stages"]) == 1:
        stdout.print(f"boundary: none (one whole-model stage); {b['token_id_bytes']} B of token id per token")
    else:
        stdout.print(f"boundary: {b['dense']} B/token dense, {b['compressed']} B/token with SSN "
                     f"({b['ratio']:.1f}x), plus {b['token_id_bytes']} B of token id")
    bw = p["required_bandwidth_mbps"]
    stdout.print(f"bandwidth per node ({bw['stage']}): {human_rate(bw['bf16'])} Mbit/s with a bf16 all-reduce, "
                 f"{human_rate(bw['fp32'])} Mbit/s with fp32")
