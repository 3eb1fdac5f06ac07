"""``agoractl export`` and ``agoractl eval``: a trained run as a Hugging Face Llama directory, and its
checkpoint's held-out loss and perplexity (recorded for the Dashboard), scored as lm-eval-harness scores
documents. Thin: parse, check, call
:mod:`agoractl.ops.export` / :mod:`agoractl.ops.evaluate`, render."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from agoractl.cli.common import JsonOpt, ManifestArg, SetOpt, load
from agoractl.cli.output import emit, note, stdout
from agoractl.errors import UsageError


class Source(str, enum.Enum):
    store = "store"
    central = "central"


SourceOpt = Annotated[Source, typer.Option(
    "--from", help="store: every stage's checkpoint at one step from checkpoints.store (a swarm); central: "
                   "the checkpoint `launch central` keeps in <checkpoints.store>/central.")]
StepOpt = Annotated[Optional[int], typer.Option(
    "--step", help="Checkpoint step (every stage must have it; default: the latest).", show_default=False)]


def export(
    manifest: ManifestArg,
    to: Annotated[Path, typer.Option("--to", help="New (or empty) directory for the Hugging Face model.",
                                     show_default=False)],
    step: StepOpt = None,
    source: SourceOpt = Source.store,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Assemble the run's model into a Hugging Face LlamaForCausalLM directory.

    config.json, weights with the SSN factors folded into dense matrices, and the tokenizer, which
    transformers and lm-eval load offline. Nothing is written to --to unless the export is whole."""
    run = load(manifest, set_)
    from agoractl.ops import export as ex

    ex.check_exportable(run)
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise UsageError(f"--to {to}: exists and is not an empty directory", hint="choose a new directory")
    got_step, state = ex.state_from_store(run, step) if source is Source.store else ex.state_from_central(run, step)
    path = ex.write_export(run, state, got_step, to, source.value)
    result = {"to": str(path), "step": got_step, "source": source.value, "ssn_rank": run.model.ssn.rank,
              "files": sorted(p.name for p in path.iterdir())}
    emit(result, as_json, lambda r: stdout.print(
        f"exported step {r['step']} ({r['source']}) to {r['to']}: {', '.join(r['files'])}"))


def evaluate(
    manifest: ManifestArg,
    model: Annotated[Optional[Path], typer.Option(
        "--model", help="An exported directory (agoractl export) to score instead of the run's checkpoint; "
                        "nothing is written to the database.", show_default=False)] = None,
    shard: Annotated[Optional[list[int]], typer.Option(
        "--shard", help="Shard(s) of data.output to read documents from (default: the held-out ones; with "
                        "--model and none held out, the last).", show_default=False)] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Documents to evaluate.")] = 32,
    step: StepOpt = None,
    source: SourceOpt = Source.store,
    task_dir: Annotated[Optional[Path], typer.Option(
        "--write-task", help="Also write these documents as a local lm-eval task (JSON lines + YAML) here.",
        show_default=False)] = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Validation loss and perplexity of the latest checkpoint on the held-out shards.

    The result is written to the Health Monitor's database (table health_evals), where the Dashboard shows it.

    The held-out shards are the last data.heldout_shards, which `agoractl shard` reserves (trainers never claim
    them). Documents are scored by rolling-window log-likelihood, as lm-eval-harness's loglikelihood_rolling
    scores them; loss is the mean NLL per token (nats), perplexity exp(loss). With --model, an exported model
    is scored instead (token and byte perplexity; --write-task gives lm-eval the same documents)."""
    run = load(manifest, set_)
    from agoractl.data.index import read_index
    from agoractl.ops import evaluate as ev

    if model is None:
        if task_dir is not None:
            raise UsageError("--write-task needs --model", hint="export the checkpoint first: agoractl export")
        result = ev.checkpoint_loss(run, shard or ev.heldout_shards(run), limit, source.value, step)
        from agoractl.services.health import evals  # sqlalchemy, alembic: only here

        result["database"] = evals.record(run, result)
        emit(result, as_json, lambda r: stdout.print(
            f"step {r['step']} ({r['source']}): validation loss {r['loss']:.4f}, perplexity {r['perplexity']:.4f} "
            f"on {r['documents']} documents, {r['tokens']:,} tokens of shard(s) "
            f"{', '.join(map(str, r['shards']))}; recorded in {r['database']}"))
        return
    if not (model / "config.json").is_file():
        raise UsageError(f"--model {model}: no config.json", hint="export one with: agoractl export FILE --to DIR")
    from agoractl.data.tokenizers import load_tokenizer
    from agoractl.ops.export import load_exported

    index = read_index(run.data.output)
    shards = shard or index.heldout or [len(index.shards) - 1]
    documents = ev.heldout_documents(run, shards, limit)
    net = load_exported(model)
    result = ev.perplexity(lambda ids: net(ids).logits, load_tokenizer(run), documents, run.model.seq_len)
    result["shards"] = shards
    if task_dir is not None:
        result["task_dir"] = str(ev.write_lm_eval_task(documents, task_dir))
        note(f"lm-eval task {ev.TASK} in {task_dir}: lm_eval --model hf --model_args pretrained={model} "
             f"--include_path {task_dir} --tasks {ev.TASK}")
    emit(result, as_json, lambda r: stdout.print(
        f"{r['documents']} documents, {r['tokens']:,} tokens: perplexity {r['token_perplexity']:.4f} per token, "
        f"{r['byte_perplexity']:.4f} per byte ({r['bits_per_byte']:.4f} bits/byte)"))
