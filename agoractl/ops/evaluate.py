"""Held-out perplexity of a run's model, measured the way lm-eval-harness measures it (report §3.6.4).

Documents come from held-out shards of the run's corpus (``data.output``); each is scored by
rolling log-likelihood: its tokens are predicted in windows of at most ``model.seq_len`` tokens,
the first window conditioned on the EOS token alone, each later one on the tokens right before it,
every token predicted exactly once — the windowing of lm-eval's ``loglikelihood_rolling`` with
context length 1, written out here from its definition. ``byte_perplexity`` is
``exp(total NLL / total UTF-8 bytes)`` and ``token_perplexity`` ``exp(total NLL / tokens)``; with
the bytes tokenizer they are the same number.

:func:`write_lm_eval_task` writes the same documents as a local lm-eval task (JSON lines + a task
YAML), so that ``lm_eval --include_path DIR --tasks agoractl_heldout`` scores the exported model on
exactly these sequences, offline.

:func:`checkpoint_loss` scores a run's checkpoint itself (agoractl's own model, no export) on the shards
``agoractl shard`` held out (``data.heldout_shards``): validation loss (mean NLL per token, nats) and perplexity.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import pyarrow.parquet as pq
import torch

from agoractl.data import remote
from agoractl.data.index import index_url, read_index
from agoractl.data.tokenizers import Tokenizer
from agoractl.errors import UsageError
from agoractl.manifest.schema import Run

TASK = "agoractl_heldout"


def rolling_windows(tokens: Sequence[int], prefix: int, max_len: int) -> Iterator[tuple[list[int], list[int]]]:
    """(window inputs, scored targets): the last ``len(targets)`` positions of the inputs predict the
    targets; every token is a target exactly once; inputs are at most `max_len` long; the first
    window is conditioned on `prefix`."""
    tokens = list(tokens)
    done = 0
    while done < len(tokens):
        end = min(done + max_len, len(tokens))
        if done == 0:
            yield [prefix] + tokens[:end - 1], tokens[:end]
        else:
            yield tokens[max(0, end - max_len - 1):end - 1], tokens[done:end]
        done = end


@torch.no_grad()
def document_nll(logits_fn: Callable[[torch.Tensor], torch.Tensor], tokens: Sequence[int], prefix: int,
                 max_len: int) -> float:
    """Total negative log-likelihood (nats) of `tokens` under the model `logits_fn` (ids [1, T] →
    logits [1, T, V]), scored in rolling windows."""
    total = 0.0
    for inputs, targets in rolling_windows(tokens, prefix, max_len):
        logp = torch.log_softmax(logits_fn(torch.tensor([inputs], dtype=torch.long))[0].double(), dim=-1)
        scored = logp[len(inputs) - len(targets):]
        total -= float(scored.gather(1, torch.tensor(targets, dtype=torch.long)[:, None]).sum())
    return total


def heldout_shards(run: Run) -> list[int]:
    """The shards the index holds out; a one-line UsageError when it holds none."""
    index = read_index(run.data.output)
    if not index.heldout:
        how = "rerun `agoractl shard FILE` to record them" if run.data.heldout_shards else \
            "set data.heldout_shards (e.g. 1) and rerun `agoractl shard FILE`, or pass --shard"
        raise UsageError(f"{index_url(run.data.output)}: no held-out shards", hint=how)
    return index.heldout


def checkpoint_loss(run: Run, shards: Sequence[int], limit: int, source: str = "store",
                    step: Optional[int] = None) -> dict:
    """Validation loss and perplexity of the run's checkpoint (`step`, default the latest; ``source`` store:
    every stage's at one step; central: ``launch central``'s) on up to `limit` documents of `shards`."""
    from agoractl.data.tokenizers import load_tokenizer
    from agoractl.model.build import build_model
    from agoractl.ops.export import state_from_central, state_from_store

    documents = heldout_documents(run, shards, limit)
    got, state = state_from_store(run, step) if source == "store" else state_from_central(run, step)
    model = build_model(run)
    model.load_state_dict(state)
    model.eval()
    r = perplexity(model, load_tokenizer(run), documents, run.model.seq_len)
    loss = r["nll"] / r["tokens"]
    return {"run": run.metadata.name, "step": got, "source": source, "shards": list(shards),
            "documents": r["documents"], "tokens": r["tokens"], "loss": loss, "perplexity": math.exp(loss)}


def heldout_documents(run: Run, shards: Sequence[int], limit: int) -> list[str]:
    """Up to `limit` non-empty documents from the given shards of ``data.output``, in stored order."""
    index = read_index(run.data.output)
    out: list[str] = []
    for i in shards:
        if not 0 <= i < len(index.shards):
            raise UsageError(f"--shard {i}: the shard index has shards 0-{len(index.shards) - 1}")
        url = index.shard_url(run.data.output, i)
        fs, path = remote.filesystem(url)
        with fs.open(path, "rb") as f:
            texts = pq.read_table(f, columns=[index.text_column]).column(0).to_pylist()
        out.extend(t for t in texts if t)
        if len(out) >= limit:
            break
    if not out:
        raise UsageError(f"--shard {', '.join(map(str, shards))}: no documents to evaluate on")
    return out[:limit]


def perplexity(logits_fn: Callable[[torch.Tensor], torch.Tensor], tok: Tokenizer, documents: Sequence[str],
               max_len: int) -> dict:
    """Rolling-window perplexity over `documents` (see the module docstring)."""
    nll = 0.0
    tokens = 0
    nbytes = 0
    for text in documents:
        ids = tok.encode(text)
        nll += document_nll(logits_fn, ids, tok.eos_id, max_len)
        tokens += len(ids)
        nbytes += len(text.encode("utf-8"))
    return {"documents": len(documents), "tokens": tokens, "bytes": nbytes, "nll": nll,
            "token_perplexity": math.exp(nll / tokens), "byte_perplexity": math.exp(nll / nbytes),
            "bits_per_byte": nll / nbytes / math.log(2)}


def write_lm_eval_task(documents: Sequence[str], directory: Path) -> Path:
    """A local lm-eval task over `documents`: ``<dir>/heldout.jsonl`` and ``<dir>/agoractl_heldout.yaml``."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in documents))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data.resolve()))}\n"
        "test_split: test\n"
        "output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\n"
        "doc_to_target: '{{text}}'\n"
        "metric_list:\n"
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    return directory
