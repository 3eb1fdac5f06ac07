"""``agoractl checkpoint publish|fetch|list``: stage checkpoints in ``checkpoints.store``.

A checkpoint directory on disk holds ``model.safetensors`` (the stage's trainable parameters,
global names), optionally ``optimizer.safetensors`` + ``optimizer.json`` (an AdamW state dict) and
``meta.json``; ``fetch --to DIR`` writes exactly what ``publish --from DIR`` reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from agoractl import storage
from agoractl.cli.common import JsonOpt, ManifestArg, SetOpt, StageOpt, load, stage_index
from agoractl.cli.output import emit, human_bytes, note, stdout
from agoractl.errors import UsageError
from agoractl.manifest.schema import Run

# torch, safetensors and the store are imported inside the commands, after the usage checks: a wrong
# --stage or manifest comes back in about a second, and `checkpoint list|fetch` never import torch.

app = typer.Typer(
    help="Publish, fetch and list stage checkpoints in checkpoints.store (local, file:// or s3://).",
    no_args_is_help=True,
    epilog="Examples:\n\n  agoractl checkpoint list manifests/local-cpu.yaml\n\n"
           "  agoractl checkpoint fetch manifests/local-cpu.yaml --stage head --to ckpt/\n\n"
           "  agoractl checkpoint publish manifests/local-cpu.yaml --stage head --from ckpt/ --step 100",
)

StepOpt = Annotated[Optional[int], typer.Option("--step", help="Training step of the checkpoint.", show_default=False)]


def _read_local(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"--from {path.parent}: no {what} ({path.name})") from None


def _check_model(run: Run, index: int, state: dict, path: Path) -> None:
    from agoractl.ops.analyze import stage_shapes

    shapes = stage_shapes(run, index)
    missing = [n for n in shapes if n not in state]
    extra = sorted(set(state) - set(shapes))
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise UsageError(f"{path}: not a checkpoint of stage {run.stage_names()[index]} ({what}; "
                         f"{len(missing)} missing, {len(extra)} unexpected)",
                         hint="check --stage, and that the manifest is the run's")
    for n, shape in shapes.items():
        if tuple(state[n].shape) != shape:
            raise UsageError(f"{path}: tensor {n} has shape {list(state[n].shape)}; the stage has {list(shape)}",
                             hint="check --stage, and that the manifest is the run's")


@app.command()
def publish(
    file: ManifestArg,
    stage: StageOpt,
    from_: Annotated[Path, typer.Option("--from", help="Directory holding model.safetensors (and optionally "
                                        "optimizer.safetensors + optimizer.json, meta.json).", show_default=False)],
    step: StepOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a complete checkpoint at the same step.")] = False,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Publish a stage checkpoint from a local directory; LATEST moves last, retention follows."""
    run = load(file, set_)  # usage errors before torch is imported: they come back at once
    index = stage_index(run, stage)
    if not from_.is_dir():
        raise UsageError(f"--from {from_}: no such directory")
    import safetensors.torch

    from agoractl.ops import optimizer_state
    from agoractl.ops.checkpoint import META_FILE, MODEL_FILE, OPTIMIZER_JSON, OPTIMIZER_TENSORS, CheckpointStore

    meta: dict[str, Any] = {}
    if (from_ / META_FILE).is_file():
        try:
            meta = json.loads((from_ / META_FILE).read_text())
        except ValueError as e:
            raise UsageError(f"{from_ / META_FILE}: not JSON ({e})") from None
        if meta.get("stage") not in (None, stage):
            raise UsageError(f"{from_ / META_FILE}: a checkpoint of stage {meta['stage']}, not {stage}",
                             hint=f"use --stage {meta['stage']}")
    if step is None:
        step = meta.get("step")
        if not isinstance(step, int):
            raise UsageError(f"--step: required ({from_ / META_FILE} gives no step)")
    data = _read_local(from_ / MODEL_FILE, "model")
    try:
        model_state = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise UsageError(f"{from_ / MODEL_FILE}: not a safetensors file ({e})") from None
    _check_model(run, index, model_state, from_ / MODEL_FILE)
    opt = None
    if (from_ / OPTIMIZER_JSON).is_file():
        try:
            tensors = (safetensors.torch.load(_read_local(from_ / OPTIMIZER_TENSORS, "optimizer tensors"))
                       if (from_ / OPTIMIZER_TENSORS).is_file() else {})
            opt = optimizer_state.decode(json.loads((from_ / OPTIMIZER_JSON).read_text()), tensors)
        except (ValueError, KeyError) as e:
            raise UsageError(f"{from_ / OPTIMIZER_JSON}: unreadable optimizer state ({e})") from None
    keep = {k: v for k, v in meta.items() if k not in ("stage", "step", "time", "files", "manifest_hash")}
    store = CheckpointStore(run)
    existed = step in store.steps(stage)
    url = store.publish(stage, step, model_state, opt, {**keep, "published_from": str(from_.resolve())},
                        overwrite=force)
    latest = store.latest_step(stage)
    result = {"stage": stage, "step": step, "url": url, "latest": latest, "skipped": existed and not force,
              "optimizer": opt is not None}
    if result["skipped"]:
        note(f"a complete checkpoint of {stage} at step {step} exists already; kept it (use --force to replace)")
    emit(result, as_json, lambda r: stdout.print(f"{'kept' if r['skipped'] else 'published'} {r['url']} "
                                                  f"(LATEST: step {r['latest']})"))


@app.command()
def fetch(
    file: ManifestArg,
    stage: StageOpt,
    to: Annotated[Path, typer.Option("--to", help="Local directory to write the checkpoint into.",
                                     show_default=False)],
    step: Annotated[Optional[int], typer.Option("--step", help="Step to fetch; default LATEST.",
                                                show_default=False)] = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Fetch a stage checkpoint (LATEST, or --step N), verified against its meta.json."""
    run = load(file, set_)
    stage_index(run, stage)
    from agoractl.ops.checkpoint import META_FILE, CheckpointStore

    store = CheckpointStore(run)
    meta, blobs = store.read_files(stage, step)
    if to.exists() and not to.is_dir():
        raise UsageError(f"--to {to}: exists and is not a directory")
    # Tensors first, meta.json last: a fetch cut short never looks complete.
    for name in sorted(blobs):
        storage.write_bytes_atomic(str(to / name), blobs[name])
    storage.write_bytes_atomic(str(to / META_FILE), json.dumps(meta, indent=2).encode())
    result = {"stage": stage, "step": meta["step"], "to": str(to), "files": sorted([*blobs, META_FILE]),
              "bytes": sum(len(b) for b in blobs.values()), "manifest_hash": meta.get("manifest_hash")}
    emit(result, as_json, lambda r: stdout.print(f"fetched {stage} step {r['step']} into {r['to']} "
                                                  f"({human_bytes(r['bytes'])})"))


@app.command(name="list")
def list_(file: ManifestArg, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """List the published checkpoints of every stage, and the steps with replica snapshots."""
    from agoractl.ops.checkpoint import CheckpointStore

    run = load(file, set_)
    store = CheckpointStore(run)
    rows = store.list()
    snapshots = {s: store.snapshot_steps(s) for s in store.snapshot_stages()}
    emit({"store": store.url, "checkpoints": rows, "snapshots": snapshots}, as_json, _render)


def _render(data: dict) -> None:
    if not data["checkpoints"]:
        stdout.print(f"no checkpoints in {data['store']}")
    else:
        t = Table(title=f"checkpoints in {data['store']}")
        for col in ("stage", "step", "latest", "time", "size", "optimizer"):
            t.add_column(col, justify="right" if col in ("step", "size") else "left")
        for r in data["checkpoints"]:
            t.add_row(r["stage"], str(r["step"]), "LATEST" if r["latest"] else "", r["time"] or "",
                      human_bytes(r["bytes"]), "yes" if r["optimizer"] else "no")
        stdout.print(t)
    for stage, steps in data["snapshots"].items():
        shown = ", ".join(map(str, steps[:12])) + (f", ... ({len(steps)} steps)" if len(steps) > 12 else "")
        stdout.print(f"snapshots of {stage}: {shown}")

