"""Next-token predictions of a stage's replicas, for the Jensen–Shannon distance (seed 002).

Each replica of the stage under analysis is evaluated as the whole model: head → bodies → tail,
with that stage's parameters taken from the replica's snapshot and every other stage set to its
*context*: the consensus mean of its own replicas' snapshots at the same step, else its newest
checkpoint at or before that step (else LATEST), else the manifest's seeded initialisation. Which
one was used is reported. Everything upstream of the stage is shared by the replicas, so its
output is computed once per step.

The probe batch is fixed: ``--probe PATH`` (a parquet file with the manifest's text column, or a
UTF-8 text file), else the run's first sequences from its shards
(:func:`agoractl.data.stream.run_sequences`), else seeded random tokens; its source is reported.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from agoractl import storage
from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.schema import Run
from agoractl.ops.checkpoint import CheckpointStore
from agoractl.algorithms.consensus import js_divergence
from agoractl.ops.divergence import pair_values

PROBE_SEED = 0


def _pack(token_lists: list[list[int]], seq_len: int, batch: int) -> torch.Tensor:
    flat = [t for doc in token_lists for t in doc]
    if len(flat) < 2:
        raise UsageError("--probe: the probe text holds fewer than 2 tokens", hint="give a longer probe file")
    length = min(seq_len, len(flat))
    rows = [flat[i:i + length] for i in range(0, len(flat) - length + 1, length)][:batch]
    return torch.tensor(rows, dtype=torch.long)


def _probe_file(run: Run, path: str, batch: int) -> torch.Tensor:
    from agoractl.data.tokenizers import load_tokenizer

    tok = load_tokenizer(run)
    fs, p = storage.filesystem(path)
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            with fs.open(p, "rb") as f:
                table = pq.read_table(f)
            col = run.data.text_column
            if col not in table.column_names:
                raise UsageError(f"--probe {path}: no column {col!r} (data.text_column); columns are "
                                 f"{', '.join(table.column_names)}")
            texts = [t for t in table.column(col).to_pylist() if t]
        else:
            with fs.open(p, "rb") as f:
                texts = [f.read().decode("utf-8")]
    except FileNotFoundError:
        raise UsageError(f"--probe {path}: no such file") from None
    except UnicodeDecodeError:
        raise UsageError(f"--probe {path}: not UTF-8 text (give a .parquet file or a text file)") from None
    need = batch * run.model.seq_len
    docs, total = [], 0
    for t in texts:
        docs.append(list(tok.encode(t)) + [tok.eos_id])
        total += len(docs[-1])
        if total >= need:
            break
    return _pack(docs, run.model.seq_len, batch)


def probe_batch(run: Run, path: Optional[str] = None, batch: int = 8) -> tuple[torch.Tensor, dict[str, Any]]:
    """The fixed probe token batch [B, T] and where it came from."""
    if batch < 1:
        raise UsageError(f"--probe-batch must be at least 1; got {batch}")
    if path:
        tokens = _probe_file(run, path, batch)
        return tokens, {"kind": "file", "path": path, "sequences": tokens.shape[0], "tokens": tokens.shape[1]}
    try:
        from agoractl.data.stream import run_sequences

        rows = []
        for seq in run_sequences(run):
            rows.append(torch.as_tensor(seq, dtype=torch.long)[: run.model.seq_len])
            if len(rows) == batch:
                break
        if rows:
            tokens = torch.stack(rows)
            return tokens, {"kind": "shards", "output": run.data.output, "sequences": len(rows),
                            "tokens": tokens.shape[1]}
        reason = f"the shards under {run.data.output} hold no full sequence"
    except RuntimeFailure as e:  # no shard index yet: say so and fall back
        reason = e.message
    g = torch.Generator().manual_seed(PROBE_SEED)
    tokens = torch.randint(0, run.model.vocab_size, (batch, run.model.seq_len), generator=g)
    return tokens, {"kind": "random", "seed": PROBE_SEED, "sequences": batch, "tokens": run.model.seq_len,
                    "reason": reason}


def consensus_state(store: CheckpointStore, stage: str, step: int) -> Optional[tuple[dict[str, torch.Tensor], int]]:
    """Element-wise mean of the stage's replica snapshots at `step` (one replica in memory at a
    time, plus the float64 running sum), and the replica count; None without snapshots there."""
    total: Optional[dict[str, torch.Tensor]] = None
    count = 0
    dtypes: dict[str, torch.dtype] = {}
    for _, state in store.iter_snapshot(stage, step):
        if total is None:
            total = {k: v.double().clone() for k, v in state.items()}
            dtypes = {k: v.dtype for k, v in state.items()}
        else:
            for k, v in state.items():
                total[k] += v.double()
        count += 1
    if total is None:
        return None
    return {k: (v / count).to(dtypes[k]) for k, v in total.items()}, count


def context_state(store: CheckpointStore, stage: str, step: int) -> tuple[Optional[dict[str, torch.Tensor]], str]:
    """The state another stage takes in the assembled model at `step`, and a line saying which."""
    if step in store.snapshot_steps(stage):
        found = consensus_state(store, stage, step)
        if found is not None:
            return found[0], f"consensus mean of {found[1]} snapshot(s) at step {step}"
    published = store.steps(stage)
    if published:
        before = [s for s in published if s <= step]
        chosen = before[-1] if before else store.latest_step(stage)
        if chosen is not None:
            return store.load(stage, chosen).model_state, f"checkpoint at step {chosen}"
    return None, "initialisation (no snapshot or checkpoint of this stage)"


def _load(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).splitlines()[0]
        raise RuntimeFailure(f"{what}: does not match the manifest's stage ({first[:200]})",
                             hint="analyse with the manifest the run was started from") from None


class AssembledModel:
    """The whole pipeline for one step: context stages fixed, the analysed stage swapped per replica."""

    def __init__(self, run: Run, index: int, store: CheckpointStore, device: str = "cpu"):
        from agoractl.model.build import build_stage

        self.run, self.index, self.store, self.device = run, index, store, torch.device(device)
        self.names = run.stage_names()
        self.stages = [build_stage(run, i, self.device).eval() for i in range(len(run.stages))]

    def set_context(self, step: int) -> dict[str, str]:
        """Load every other stage's context state for `step`; returns stage → which state."""
        used = {}
        for i, name in enumerate(self.names):
            if i == self.index:
                continue
            state, how = context_state(self.store, name, step)
            if state is not None:
                _load(self.stages[i], state, f"{self.store.url} stage {name} ({how})")
            else:
                from agoractl.model.llama import initialize_

                initialize_(self.stages[i], self.run)
            used[name] = how
        return used

    @torch.inference_mode()
    def replica_logprobs(self, step: int, tokens: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(replica, log-probabilities [B, T, V] in float32) for every replica of the stage at `step`."""
        tokens = tokens.to(self.device)
        wire = None
        for i in range(self.index):
            wire = self.stages[i](wire, tokens)
        stage = self.names[self.index]
        for replica, state in self.store.iter_snapshot(stage, step):
            _load(self.stages[self.index], state, self.store.snapshot_url(stage, step, replica))
            x = wire
            for i in range(self.index, len(self.stages)):
                x = self.stages[i](x, tokens)
            yield replica, torch.log_softmax(x.float(), dim=-1).cpu()


def js_between_replicas(logprobs: list[torch.Tensor]) -> dict[str, Any]:
    """JS distance (mean over positions of sqrt(JSD) in base 2) of every replica pair: mean and max
    over pairs, and the pair matrix. Fewer than two replicas give None."""
    n = len(logprobs)
    matrix = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(i + 1, n):
            # Bit-identical predictions are exactly 0 apart (the log-space formula leaves ~1e-9 of rounding).
            same = torch.equal(logprobs[i], logprobs[j])
            matrix[i, j] = matrix[j, i] = 0.0 if same else float(js_divergence(logprobs[i], logprobs[j]).sqrt().mean())
    pairs = pair_values(matrix)
    return {"mean": sum(pairs) / len(pairs) if pairs else None, "max": max(pairs) if pairs else None,
            "matrix": matrix.tolist()}
