"""``agoractl launch ...``: start nodes of a run (dht, worker, trainer), a whole local swarm, or the
centralized reference. Thin: parse, call the runtime, render. torch and the runtime (hivemind) are
imported inside each command after its usage checks, so a wrong option or manifest comes back at once."""

from __future__ import annotations

import itertools
from typing import Annotated, Optional

import typer

from agoractl.cli.common import JsonOpt, ManifestArg, SetOpt, check_device, load, require_cuda
from agoractl.cli.output import emit, note, stdout
from agoractl.data.index import read_index
from agoractl.errors import UsageError
from agoractl.training.central_resume import CentralCheckpoints

ResumeStepOpt = Annotated[Optional[int], typer.Option(
    "--resume-step", help="Resume from the checkpoint at this step (default: the latest complete one).", min=1,
    show_default=False)]
FreshOpt = Annotated[bool, typer.Option("--fresh", help="Start over at step 0 (in an empty store, or with --force).")]
ForceOpt = Annotated[bool, typer.Option("--force", help="With --fresh: move the store's checkpoints aside under "
                                                        "aside/; alone: resume from a store bound to another run.")]

UntilStepOpt = Annotated[Optional[int], typer.Option(
    "--until-step", help="Stop after this step (a checkpoint is written there); the schedule still runs to "
                         "training.max_steps, so a later launch without it continues the run (as "
                         "--set training.until_step=N).", min=1, show_default=False)]


def check_resume_options(resume_step: Optional[int], fresh: bool) -> None:
    if fresh and resume_step is not None:
        raise UsageError("--fresh and --resume-step exclude each other", hint="drop one of them")


app = typer.Typer(help="Start nodes of a run, a whole local swarm, or the centralized reference.",
                  no_args_is_help=True)


@app.command(epilog="Examples:\n\n  agoractl launch central manifests/local-cpu.yaml\n\n"
                    "  agoractl launch central manifests/local-cpu.yaml --set training.max_steps=20 --json")
def central(
    manifest: ManifestArg,
    set_: SetOpt = None,
    device: Annotated[str, typer.Option(help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N.")] = "auto",
    threads: Annotated[Optional[int], typer.Option(help="torch threads; default local.threads_per_process.",
                                                   min=1)] = None,
    microbatch: Annotated[Optional[int], typer.Option(
        help="Samples per forward/backward pass (gradients accumulate to the global batch); "
             "default workers.max_microbatch.", min=1)] = None,
    wrap: Annotated[bool, typer.Option("--wrap", help="Start another epoch over the shards when the corpus "
                                                      "is used up, instead of ending early.")] = False,
    log_every: Annotated[int, typer.Option(help="A progress line on stderr every this many steps.", min=1)] = 10,
    resume_step: ResumeStepOpt = None,
    fresh: FreshOpt = False,
    force: ForceOpt = False,
    until_step: UntilStepOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The centralized reference (report §5.5): the whole model in one process, on the run's data stream,
    with the same global batch, optimizer, schedule and clipping as the swarm. Writes
    <local.run_dir>/central-report.json (steps, tokens, tokens_per_s, loss, final_loss).

    With checkpoints.every_steps set, the whole model and its optimizer state are checkpointed under
    <checkpoints.store>/central/, and a rerun resumes from the latest one (bit for bit)."""
    run = load(manifest, set_)  # manifest errors before torch is imported: they come back at once
    check_resume_options(resume_step, fresh)
    until_step = until_step or run.training.until_step
    if until_step is not None and until_step > run.training.max_steps:
        raise UsageError(f"--until-step {until_step} is beyond training.max_steps ({run.training.max_steps})")
    if run.model.family != "llama":
        raise UsageError(f"{manifest}: launch central trains the real model; model.family is {run.model.family}",
                         hint="use a manifest with model.family: llama")
    check_device(device, allow_auto=True)
    read_index(run.data.output)  # a missing shard index: one line, before torch is imported
    checkpoints = CentralCheckpoints(run, resume_step, fresh, force)  # refusals before torch, too
    import torch

    from agoractl.data.stream import run_sequences
    from agoractl.training.central import pick_device, train_central
    from agoractl.training.report import write_report

    dev = pick_device(device)
    require_cuda(device if dev.type == "cuda" else "cpu")
    torch.set_num_threads(threads or run.local.threads_per_process)
    # Open the stream before announcing anything: a missing shard index is the first line printed.
    samples = checkpoints.skip(run_sequences(run, wrap=wrap))
    first = next(samples, None)
    samples = itertools.chain([] if first is None else [first], samples)
    note(f"central: {run.metadata.name} on {dev}, {run.training.max_steps} steps of "
         f"{run.training.global_batch_size} x {run.model.seq_len} tokens")
    note(f"central: {checkpoints.plan.describe()}")

    def progress(s: dict) -> None:
        if (s["step"] + 1) % log_every == 0 or s["step"] == 0 or s["step"] + 1 == run.training.max_steps:
            norms = " ".join(f"{k}={v:.3f}" for k, v in s["grad_norm"].items())
            note(f"step {s['step'] + 1}/{run.training.max_steps}  loss {s['loss']:.4f}  lr {s['lr']:.2e}  "
                 f"{s['tokens_per_s']:.0f} tok/s  grad norm {norms}")

    report = train_central(run, samples, dev, microbatch, progress, resume=checkpoints.load(),
                           until=until_step, on_checkpoint=checkpoints.save if checkpoints.enabled else None)
    report["resume"] = checkpoints.plan.as_dict()
    path = write_report(run.local.run_dir, "central-report.json", report)
    if not report["completed"]:
        note(f"the data stream ran out after {report['steps']} of {run.training.max_steps} steps "
             "(pass --wrap to start another epoch)")
    report["report_path"] = path
    emit(report, as_json, _render_central)


def _render_central(r: dict) -> None:
    first = r["loss"][0][1]
    if r.get("resume", {}).get("action") == "resume":
        stdout.print(f"resumed from step {r['resume']['step']} ({r['resume']['store']})")
    stdout.print(f"{r['name']}: {r['steps']} steps, {r['tokens']:,} tokens in {r['elapsed_s']:.1f} s "
                 f"({r['tokens_per_s']:,.0f} tokens/s on {r['device']})")
    stdout.print(f"loss {first:.4f} -> {r['final_loss']:.4f} (mean of the last steps)")
    stdout.print(f"report: {r['report_path']}")

