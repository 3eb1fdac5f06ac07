"""``manifest plan``: what a manifest costs, computed from the manifest alone (no model is built).

Per stage: trainable and dense-equivalent parameters, worker memory; per boundary: bytes per token,
dense and with the SSN codec; per SPARTA round: the payload; per node: the bandwidth requirement of
report §3.5.2.1. The parameter formulas are the model's own layout (``agoractl.model.llama``
checks that it builds exactly these counts), so the plan and the model cannot disagree silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from agoractl.manifest.schema import Model, Run

FP32 = 4


@dataclass(frozen=True)
class StageCounts:
    trainable: int
    """Parameters the optimizer updates (what SPARTA averages)."""
    dense: int
    """The same stage without SSN reparameterization (dense-equivalent)."""
    buffers: int
    """Fixed, non-trainable values (U_k, fixed token embedding)."""


def block_params(m: Model, rank: int | None) -> int:
    """One Llama block: 2 RMSNorms, q/k/v/o, SwiGLU gate/up/down; o and down are Z @ U_k^T under SSN."""
    d, hd = m.d_model, m.head_dim
    q_dim, kv_dim = m.n_heads * hd, m.kv_heads * hd
    out_width = rank if rank else d
    attn = d * q_dim + 2 * d * kv_dim + q_dim * out_width
    mlp = 2 * d * m.d_ff + m.d_ff * out_width
    return 2 * d + attn + mlp


def surrogate_layer_params(m: Model) -> int:
    """One surrogate layer: Linear(d, d) with bias (report §3.5.1.1)."""
    return m.d_model * m.d_model + m.d_model


def stage_counts(run: Run, index: int) -> StageCounts:
    """Trainable, dense-equivalent and buffer counts of stage `index`."""
    m, stage = run.model, run.stages[index]
    V, d = m.vocab_size, m.d_model
    if m.family == "surrogate":
        n = stage.layers * surrogate_layer_params(m) + m.surrogate.dummy_params
        if stage.embeds:
            n += V * d
        if stage.computes_loss:
            n += d * V
        return StageCounts(n, n, 0)
    k = m.ssn.rank
    trainable = stage.layers * block_params(m, k)
    dense = stage.layers * block_params(m, None)
    buffers = 0
    if k:
        # U_k (d x k) everywhere; the fixed token embedding wherever a stage encodes or decodes.
        buffers = d * k + V * d
    if stage.embeds:
        trainable += V * (k if k else d)
        dense += V * d
    if stage.computes_loss:
        trainable += d + d * V
        dense += d + d * V
    return StageCounts(trainable, dense, buffers)


def stage_flops_per_sample(run: Run, index: int) -> int:
    """Model FLOPs to train one sample (seq_len tokens) through stage `index`: forward 2 FLOPs per multiply-add
    of every dense-equivalent matmul weight (blocks; the tail's LM head) plus attention's scores and weighted
    sum (2 * 2 * seq_len * d per token and block, causal mask not discounted); training = 3 x forward (the
    backward costs two forwards). The worker's recompute of the forward in its backward is NOT counted (model
    FLOPs, as MFU counts them): it executes 4 x forward, see executed_flops_per_sample in the plan."""
    m, stage = run.model, run.stages[index]
    T, d = m.seq_len, m.d_model
    if m.family == "surrogate":
        weights = stage.layers * surrogate_layer_params(m)
        attention = 0
    else:
        weights = stage.layers * block_params(m, None)
        attention = stage.layers * 2 * 2 * T * d
    if stage.computes_loss:
        weights += d * m.vocab_size
    return 3 * T * (2 * weights + attention)


def boundary_bytes_per_token(run: Run, wire_bytes: int = FP32) -> dict:
    """Activation bytes per token crossing one stage boundary: dense (d values) vs SSN (k values).

    Token ids travel with every request in both cases (the tail needs labels), so they are given
    separately and left out of the ratio, which is then exactly d/k. A run of one stage (role whole) has no
    boundary: dense and compressed are 0 and the ratio 1 (only token ids travel).
    """
    m = run.model
    if len(run.stages) == 1:
        return {"dense": 0, "compressed": 0, "ratio": 1.0, "token_id_bytes": 4}
    dense = m.d_model * wire_bytes
    compressed = (m.ssn.rank or m.d_model) * wire_bytes
    return {"dense": dense, "compressed": compressed, "ratio": dense / compressed, "token_id_bytes": 4}


def required_bandwidth_mbps(run: Run, counts: StageCounts, a_f: float = 3, a_b: float = 3,
                            ar_time_s: float = 10, ar_params: str = "dense") -> dict:
    """Report §3.5.2.1: 32(a_f+a_b)·seq_len·hidden + AR_dtype·AR_payload/AR_time bits per second.

    hidden is the width actually on the wire (k under SSN). AR_payload is fraction x num_params for
    SPARTA, all parameters every round for FGDiLoCo, none without data parallelism. The report
    substitutes the stage's dense-equivalent parameter count (its worst case; it reproduces the
    ~113 / ~186 Mbit/s of Pluralis-8B); `ar_params="trainable"` uses what a reparameterized stage
    really sends.
    """
    m, dp = run.model, run.data_parallel
    hidden = m.ssn.rank or m.d_model
    activations = 32 * (a_f + a_b) * m.seq_len * hidden if len(run.stages) > 1 else 0  # whole: no boundary
    num_params = counts.dense if ar_params == "dense" else counts.trainable
    share = {"sparta": dp.sparta.fraction, "fgdiloco": 1.0, "none": 0.0}[dp.method]
    payload = share * num_params
    return {
        "bf16": (activations + 16 * payload / ar_time_s) / 1e6,
        "fp32": (activations + 32 * payload / ar_time_s) / 1e6,
    }


def contributor_stage(run: Run) -> int:
    """The stage a contributor is sized for: the heaviest body stage (report §3.5.2.1), else the heaviest."""
    idx = [i for i, s in enumerate(run.stages) if s.role == "body"] or list(range(len(run.stages)))
    return max(idx, key=lambda i: stage_counts(run, i).dense)


def make_plan(run: Run, a_f: float = 3, a_b: float = 3, ar_time_s: float = 10, ar_params: str = "dense") -> dict:
    """The whole plan as a JSON-ready dict (keys documented in `agoractl manifest plan --help`)."""
    names = run.stage_names()
    wire = 2 if run.data_parallel.sparta.wire_dtype == "bf16" else FP32
    stages = []
    for i, stage in enumerate(run.stages):
        c = stage_counts(run, i)
        start, stop = run.layer_range(i)
        stages.append({
            "name": names[i],
            "role": stage.role,
            "layers": [start, stop],
            "params": c.trainable,
            "dense_params": c.dense,
            "buffers": c.buffers,
            # fp32 master weights + AdamW m and v + fp32 gradients, plus the fixed buffers.
            "memory_bytes": 16 * c.trainable + FP32 * c.buffers,
            "sparta_bytes_per_round": int(run.data_parallel.sparta.fraction * c.trainable * wire)
            if run.data_parallel.method == "sparta" else 0,
            "required_bandwidth_mbps": required_bandwidth_mbps(run, c, a_f, a_b, ar_time_s, ar_params),
            "clip_threshold": run.clip_threshold(i),
            "flops_per_sample": stage_flops_per_sample(run, i),
            "executed_flops_per_sample": stage_flops_per_sample(run, i) * 4 // 3,
        })
    worst = contributor_stage(run)
    return {
        "name": run.metadata.name,
        "family": run.model.family,
        "stages": stages,
        "params": sum(s["params"] for s in stages),
        "dense_params": sum(s["dense_params"] for s in stages),
        "boundary_bytes_per_token": boundary_bytes_per_token(run),
        "sparta_bytes_per_round": sum(s["sparta_bytes_per_round"] for s in stages),
        "sparta_segments": run.n_segments() if run.data_parallel.method == "sparta" else None,
        "required_bandwidth_mbps": dict(stages[worst]["required_bandwidth_mbps"], stage=names[worst]),
        "assumptions": {"a_f": a_f, "a_b": a_b, "ar_time_s": ar_time_s, "ar_params": ar_params,
                        "activation_bits": 32},
    }
