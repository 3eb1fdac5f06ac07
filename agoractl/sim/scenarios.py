"""The simulator's scenarios: the documents' ablations reproduced in one process, as JSON-able dicts.

- ``fgdiloco`` (seed 002): the four variants side by side on the same data: loss per step, loss per
  simulated hour and compute utilization at each bandwidth, consensus distance (pairwise JS distance
  of next-token distributions on a fixed probe batch, pairwise L2 of parameters). Its time model is
  the seed's regime by default: a 1.5B-parameter payload, rounds of H = 100 inner steps, M = 8
  replicas, gossip accounting of global mixing (``all-to-all`` in :mod:`agoractl.sim.comm_model`:
  "gossip reduces how many other workers each worker must communicate with", so the delta's blocking
  communication "can be kept light by doing very local communication"), and a compute time per step
  calibrated so that at 200 Mbit/s DiLoCo takes 29/16 of GlobalM1's wall time ("training to 1T tokens
  at 200 Mbps takes roughly 16 weeks for GlobalM1 versus 29 weeks for DiLoCo").
- ``sparta-backward`` (report §6.2): AsyncSPARTA with the backward pinned to the forward's replicas
  versus routed stochastically.
- ``sparta-participation`` (report §6.4): a clean warm-up, then injected averaging failures at several
  participation levels (each forked from the same warm-up), then a clean recovery phase.

Every scenario trains tiny models with the workers' own code (:mod:`agoractl.sim.simulator`);
the manifest supplies the model, optimizer, schedule, clipping and data-parallel settings, and the
schedule's horizon (``training.max_steps``) is set to the simulated steps.
"""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from agoractl.manifest.schema import Run
from agoractl.sim.comm_model import GLOBAL_MIXING, CommModel
from agoractl.algorithms.fgdiloco import VARIANTS, variant_mixing
from agoractl.sim.simulator import Batcher, PipelineSim, lesson_sequences, open_sequences, run_fgdiloco

SCENARIOS = ("fgdiloco", "sparta-backward", "sparta-participation")

SEED_PAYLOAD_PARAMS = 1.5e9
"""The seed's model (1.5B parameters): the payload of every mixing in the time model by default."""
SEED_INNER_STEPS = 100
"""The seed's H: one simulated round stands for a round of this many inner steps in the time model."""
SEED_REPLICAS = 8
"""The seed's M: the replica count of the time model in the seed's regime."""
SEED_GLOBAL_MIXING = "all-to-all"
"""How the seed's regime costs a global mixing: one payload exchange per partner (gossip accounting)."""
SEED_DILOCO_OVER_GLOBAL_M1 = 29 / 16
"""DiLoCo's wall time over GlobalM1's at 200 Mbit/s in the seed (29 vs 16 weeks to 1T tokens)."""


def seed_step_time_s(global_mixing: str = SEED_GLOBAL_MIXING, payload_params: float = SEED_PAYLOAD_PARAMS,
                     bytes_per_param: int = 4) -> float:
    """Compute seconds per inner step that reproduce the seed's 29 vs 16 weeks at 200 Mbit/s, M = 8, H = 100.

    GlobalM1 has no blocking communication and DiLoCo blocks on a global Mix2, so their wall-time ratio
    is (compute + global) / max(compute, global); the seed's 1.8 is met with GlobalM1's Mix1 hidden under
    the round's compute: compute = global / (29/16 − 1). 20.7 s under ``all-to-all``, 5.2 s under
    ``butterfly``.
    """
    comm = CommModel(200.0, 0.0, global_mixing)
    mix = comm.collective_s("global", payload_params * bytes_per_param, SEED_REPLICAS)
    return mix / (SEED_DILOCO_OVER_GLOBAL_M1 - 1) / SEED_INNER_STEPS

Progress = Callable[[str], None]


def _with_horizon(run: Run, steps: int, **updates) -> Run:
    """The run with the schedule's horizon set to `steps` (and any top-level section updates)."""
    training = run.training.model_copy(update={"max_steps": max(1, steps)})
    return run.model_copy(update={"training": training, **updates})


class Data:
    """The scenario's data: training streams from the data's first sequence, and a fixed held-out probe batch.

    Training starts where a swarm's trainers and ``launch central`` start, so a simulated run trains on the
    samples a live run does, in the same order. With shards, the probe is the `probe_samples` sequences that
    follow the last of the `train_samples` any simulated run may train on, from the same corpus and never
    trained on; when the shards hold fewer, and with synthetic text, it is lesson text from another
    generator seed.
    """

    def __init__(self, run: Run, data: str, seed: int, probe_samples: int, train_samples: int):
        self.run, self.data, self.seed = run, data, seed
        _, self.description = open_sequences(run, data, seed)
        probe = []
        if self.description.startswith("shards:"):
            from agoractl.data.stream import run_sequences

            probe = list(itertools.islice(run_sequences(run), train_samples, train_samples + probe_samples))
            self.probe_source = f"the {probe_samples} sequences after the first {train_samples} (the most a " \
                                f"simulated run trains on): never trained on"
        if len(probe) < probe_samples:
            stream = lesson_sequences(run, seed=seed + 1_000_003)
            probe = [next(stream) for _ in range(probe_samples)]
            self.probe_source = f"{probe_samples} sequences of lesson text from another generator seed" + (
                f" (the shards hold fewer than {train_samples + probe_samples} sequences)"
                if self.description.startswith("shards:") else "")
        self.probe = torch.stack(probe)

    def stream(self) -> Iterator[torch.Tensor]:
        stream, _ = open_sequences(self.run, self.data, self.seed)
        return stream


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def _bw_key(bw: float) -> str:
    return f"{bw:g}"


# ---- fgdiloco -------------------------------------------------------------------------------------


@dataclass
class TimeModel:
    """How simulated rounds become seconds: the payload of one mixing, and the compute of one round."""

    bandwidths_mbps: list[float]
    latency_ms: float
    payload_params: float
    bytes_per_param: int
    step_time_s: float
    inner_steps: int
    replicas: int
    global_mixing: str
    source: str = ""

    def round_time(self, variant: str, bandwidth_mbps: float):
        kind1, kind2 = variant_mixing(variant)
        comm = CommModel(bandwidth_mbps, self.latency_ms, self.global_mixing)
        payload, m = self.payload_params * self.bytes_per_param, self.replicas
        return comm.round_time(self.inner_steps * self.step_time_s,
                               overlapped_s=comm.collective_s(kind1, payload, m),   # Mix1: non-blocking
                               blocking_s=comm.collective_s(kind2, payload, m))     # Mix2: blocking

    def describe(self) -> dict:
        return {
            "payload_params": self.payload_params, "bytes_per_param": self.bytes_per_param,
            "step_time_s": self.step_time_s, "inner_steps_per_round": self.inner_steps,
            "replicas": self.replicas, "global_mixing": self.global_mixing,
            "latency_ms": self.latency_ms, "source": self.source,
            "comm": "full-duplex links; global mixing = " + (
                "all-to-all (gossip accounting: an exchange with each of the M-1 others), (M-1) x payload / "
                "bandwidth + latency" if self.global_mixing == "all-to-all" else
                "butterfly all-reduce, 2(M-1)/M x payload / bandwidth + 2 x latency") +
                    "; local = pairwise exchange, payload / bandwidth + latency; Mix1 overlaps the "
                    "round's compute, Mix2 blocks after it; utilization = compute / wall",
        }


def fgdiloco(run: Run, *, variants: Optional[list[str]] = None, replicas: int = 4, rounds: int = 15,
             inner_steps: Optional[int] = None, batch: Optional[int] = None, bandwidths_mbps=(100.0, 200.0),
             latency_ms: Optional[float] = None, payload_params: Optional[float] = SEED_PAYLOAD_PARAMS,
             bytes_per_param: int = 4, step_time_s: Optional[float | str] = "seed",
             time_inner_steps: int = SEED_INNER_STEPS, time_replicas: Optional[int] = SEED_REPLICAS,
             global_mixing: str = SEED_GLOBAL_MIXING, data: str = "auto", probe_samples: int = 16, seed: int = 0,
             progress: Optional[Progress] = None) -> dict:
    """The four FGDiLoCo variants (or `variants`) side by side; see the module docstring.

    DiLoCo runs first; every other variant then gets extra rounds, as many as fit in DiLoCo's wall time
    at the most favourable bandwidth (at most `rounds` more), until its round loss reaches DiLoCo's
    final loss (time-to-loss); extra rounds run at the schedule's final learning rate.
    ``step_time_s="seed"`` is :func:`seed_step_time_s` for `global_mixing`; ``None`` uses the step time
    measured here, with `inner_steps` per round, the simulated `replicas` and the simulated model's own
    size as payload unless `payload_params` is given. `time_replicas` is M in the time model (the seed's
    8 by default, whatever the simulated replica count; ``None``: the simulated count).
    """
    if global_mixing not in GLOBAL_MIXING:
        raise ValueError(f"global_mixing must be one of {', '.join(GLOBAL_MIXING)}; got {global_mixing!r}")
    if step_time_s == "seed":
        step_time_s = seed_step_time_s(global_mixing, payload_params or SEED_PAYLOAD_PARAMS, bytes_per_param)
    variants = list(variants or VARIANTS)
    for v in variants:
        variant_mixing(v)
    if "diloco" in variants:
        variants = ["diloco"] + [v for v in variants if v != "diloco"]
    H = inner_steps or run.data_parallel.fgdiloco.inner_steps
    batch = batch or max(1, run.training.global_batch_size // replicas)
    sim_run = _with_horizon(run, rounds * H)
    data_ = Data(sim_run, data, seed, probe_samples, 2 * rounds * H * replicas * batch)  # rounds + extra rounds
    n_params = sum(p.numel() for p in _model_params(sim_run))
    t_start = time.perf_counter()
    results: dict[str, dict] = {}
    target: Optional[float] = None
    tm: Optional[TimeModel] = None
    for v in variants:
        extra, stop = 0, None
        if target is not None and tm is not None:
            # Rounds that fit in DiLoCo's wall time at some bandwidth (at most twice the rounds).
            fit = max(int(rounds * tm.round_time("diloco", bw).wall_s // tm.round_time(v, bw).wall_s)
                      for bw in bandwidths_mbps)
            extra = min(rounds, max(0, fit - rounds))
            stop = (lambda t: lambda r, rec: rec["train_loss"] <= t)(target)
        if progress:
            progress(f"simulate fgdiloco: {v} ({replicas} replicas x {rounds} rounds x H={H})")
        out = run_fgdiloco(sim_run, v, replicas=replicas, rounds=rounds, inner_steps=H, batch=batch,
                           stream=data_.stream(), probe=data_.probe, seed=seed, extra_rounds=extra, stop=stop)
        if tm is None:      # built after the first variant, which measures the step time
            measured = step_time_s is None
            m = replicas if measured or time_replicas is None else time_replicas
            tm = TimeModel(bandwidths_mbps=list(bandwidths_mbps),
                           latency_ms=run.admission.max_latency_ms if latency_ms is None else latency_ms,
                           payload_params=payload_params if payload_params is not None else float(n_params),
                           bytes_per_param=bytes_per_param,
                           step_time_s=out["step_time_s"] if measured else step_time_s,
                           inner_steps=H if measured else time_inner_steps, replicas=m, global_mixing=global_mixing,
                           source=("measured on this machine: one simulated round = H inner steps of the measured "
                                   "step time" if measured else
                                   f"the seed's regime: one simulated round stands for a round of "
                                   f"{time_inner_steps} inner steps of {step_time_s:.4g} s on {m} replicas"))
        results[v] = _fgdiloco_variant(v, out, rounds, H, tm)
        if v == "diloco":
            target = results[v]["final_loss"]
    for name, res in results.items():
        # Simulated hours at the end of the first round whose loss reaches DiLoCo's final loss.
        res["hours_to_diloco_final"] = {
            _bw_key(bw): (None if target is None else
                          next((h for h, e in zip(res["hours"][_bw_key(bw)], res["round_loss_all"]) if e <= target), None))
            for bw in bandwidths_mbps}
    return {
        "scenario": "fgdiloco",
        "data": data_.description,
        "probe": data_.probe_source,
        "settings": {"replicas": replicas, "rounds": rounds, "inner_steps": H, "batch_per_replica": batch,
                     "seq_len": run.model.seq_len, "outer_lr": run.data_parallel.fgdiloco.outer_lr,
                     "outer_momentum": run.data_parallel.fgdiloco.outer_momentum,
                     "nesterov": run.data_parallel.fgdiloco.nesterov, "inner_lr": run.training.optimizer.lr,
                     "probe_samples": probe_samples, "seed": seed,
                     "model_params": n_params},
        "assumptions": tm.describe() if tm else {},
        "metrics": {
            "final_loss": "mean training loss of the replicas over the last round's inner steps; every sample is "
                          "new when trained on, so it is a held-out estimate",
            "hours_to_diloco_final": "simulated hours at the end of the first round whose mean loss reaches "
                                     "DiLoCo's final_loss (extra rounds allowed within DiLoCo's wall time)",
            "js_mean/js_max": "JS distance (base 2, sqrt JSD) of next-token distributions on the probe batch "
                              "between replica pairs after each outer step: mean over pairs and rounds / max",
            "l2_mean": "L2 distance of parameters between replica pairs, mean over pairs and rounds",
        },
        "bandwidths_mbps": list(bandwidths_mbps),
        "target_loss": target,
        "variants": results,
        "elapsed_s": round(time.perf_counter() - t_start, 2),
    }


def _model_params(run: Run):
    from agoractl.model.build import build_model

    return build_model(run, "meta").parameters()


def _fgdiloco_variant(v: str, out: dict, rounds: int, H: int, tm: TimeModel) -> dict:
    recs = out["rounds"]
    main, ext = recs[:rounds], recs[rounds:]
    kind1, kind2 = variant_mixing(v)
    utilization, round_wall, hours = {}, {}, {}
    for bw in tm.bandwidths_mbps:
        rt = tm.round_time(v, bw)
        key = _bw_key(bw)
        utilization[key] = round(rt.utilization, 4)
        round_wall[key] = round(rt.wall_s, 3)
        hours[key] = [round(rec["round"] * rt.wall_s / 3600, 4) for rec in recs]
    return {
        "mix1": kind1, "mix2": kind2,
        "final_loss": main[-1]["train_loss"],
        "loss": [round(x, 5) for x in out["loss"][:rounds * H]],
        "round_loss": [r["train_loss"] for r in main],
        "round_loss_all": [r["train_loss"] for r in recs],
        "eval_loss": [r["eval_loss"] for r in main],
        "extra_rounds": len(ext),
        "utilization": utilization,
        "round_wall_s": round_wall,
        "hours": hours,
        "js_mean": _mean(r["js_mean"] for r in main),
        "js_max": max(r["js_max"] for r in main),
        "l2_mean": _mean(r["l2_mean"] for r in main),
        "consensus": [{"round": r["round"], "js_mean": round(r["js_mean"], 5), "js_max": round(r["js_max"], 5),
                       "l2_mean": round(r["l2_mean"], 5)} for r in main],
        "measured_step_time_s": out["step_time_s"],
    }


# ---- SPARTA scenarios -----------------------------------------------------------------------------


def _sparta_settings(run: Run, replicas: int, microbatch: int, lag_steps: int) -> dict:
    sp = run.data_parallel.sparta
    return {"stages": len(run.stages), "replicas_per_stage": replicas, "global_batch_size": run.training.global_batch_size,
            "microbatch": microbatch, "fraction": sp.fraction, "segments": run.n_segments(),
            "every_steps": sp.every_steps, "delta_rule": sp.delta_rule, "lag_steps": lag_steps,
            "seq_len": run.model.seq_len, "lr": run.training.optimizer.lr,
            "routing": "forward: uniformly random replica per stage"}


def sparta_backward(run: Run, *, replicas: int = 4, steps: int = 150, microbatch: int = 4, lag_steps: int = 1,
                    eval_every: int = 10, data: str = "auto", probe_samples: int = 16, seed: int = 0,
                    progress: Optional[Progress] = None) -> dict:
    """Pinned versus stochastic backward under AsyncSPARTA (report §6.2), same data and forward routes."""
    sim_run = _with_horizon(run, steps)
    data_ = Data(sim_run, data, seed, probe_samples, steps * run.training.global_batch_size)
    t_start = time.perf_counter()
    variants = {}
    for rule in ("pinned", "stochastic"):
        if progress:
            progress(f"simulate sparta-backward: {rule} ({len(run.stages)} stages x {replicas} replicas, {steps} steps)")
        batcher = Batcher(data_.stream())
        sim = PipelineSim(sim_run, replicas, backward=rule, seed=seed, lag_steps=lag_steps)
        losses, evals = [], []
        for step in range(steps):
            losses.append(sim.train_step(batcher.take(run.training.global_batch_size), microbatch))
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                evals.append([step + 1, round(sim.eval_loss(data_.probe), 5)])
        variants[rule] = {"final_loss": evals[-1][1], "loss": [round(x, 5) for x in losses], "eval_loss": evals}
    return {"scenario": "sparta-backward", "data": data_.description, "probe": data_.probe_source,
            "settings": {**_sparta_settings(run, replicas, microbatch, lag_steps), "steps": steps,
                         "probe_samples": probe_samples, "seed": seed},
            "variants": variants, "elapsed_s": round(time.perf_counter() - t_start, 2)}


def sparta_participation(run: Run, *, replicas: int = 4, levels=(1.0, 0.9, 0.75, 0.5), warmup_steps: int = 20,
                         failure_steps: int = 50, recovery_steps: int = 30, microbatch: int = 4, lag_steps: int = 1,
                         eval_every: int = 10, data: str = "auto", probe_samples: int = 16, seed: int = 0,
                         progress: Optional[Progress] = None) -> dict:
    """Injected averaging failures at several participation levels (report §6.4).

    A clean warm-up is trained once; every level forks from it (same weights, data and routes), runs
    `failure_steps` where each replica completes each averaging round with probability `level`, then
    `recovery_steps` at full participation. Loss reduction is compared per phase with level 1.0.
    """
    steps = warmup_steps + failure_steps + recovery_steps
    sim_run = _with_horizon(run, steps)
    data_ = Data(sim_run, data, seed, probe_samples, steps * run.training.global_batch_size)
    probe = data_.probe
    t_start = time.perf_counter()
    gb = run.training.global_batch_size
    if progress:
        progress(f"simulate sparta-participation: warm-up ({warmup_steps} steps)")
    batcher = Batcher(data_.stream())
    base = PipelineSim(sim_run, replicas, seed=seed, lag_steps=lag_steps)
    warm_losses = [base.train_step(batcher.take(gb), microbatch) for _ in range(warmup_steps)]
    fork_eval = base.eval_loss(probe)
    batches = [batcher.take(gb) for _ in range(failure_steps + recovery_steps)]
    variants: dict[str, dict] = {}
    for level in levels:
        name = f"p{round(level * 100):d}"
        if progress:
            progress(f"simulate sparta-participation: {name} ({failure_steps} failure + {recovery_steps} recovery steps)")
        sim = copy.deepcopy(base)
        losses, evals = list(warm_losses), [[warmup_steps, round(fork_eval, 5)]]
        for i, samples in enumerate(batches):
            failing = i < failure_steps
            losses.append(sim.train_step(samples, microbatch, participation=level if failing else 1.0))
            step = warmup_steps + i + 1
            if (i + 1) % eval_every == 0 or i + 1 == failure_steps or step == steps:
                if not evals or evals[-1][0] != step:
                    evals.append([step, round(sim.eval_loss(probe), 5)])
        failure_rounds = [f for s, f in sim.participation if warmup_steps < s <= warmup_steps + failure_steps]
        at = {s: e for s, e in evals}
        fail_end = at[warmup_steps + failure_steps]
        variants[name] = {
            "level": level, "final_loss": evals[-1][1], "loss": [round(x, 5) for x in losses], "eval_loss": evals,
            "participation_failure_phase": round(_mean(failure_rounds), 4),
            "loss_fork": round(fork_eval, 5), "loss_failure_end": fail_end,
            "reduction_failure": round(fork_eval - fail_end, 5),
            "reduction_recovery": round(fail_end - evals[-1][1], 5),
        }
    ref = variants.get("p100")
    if ref:
        for v in variants.values():
            v["gap_failure_end"] = round(v["loss_failure_end"] - ref["loss_failure_end"], 5)
            v["gap_end"] = round(v["final_loss"] - ref["final_loss"], 5)
    return {"scenario": "sparta-participation", "data": data_.description, "probe": data_.probe_source,
            "settings": {**_sparta_settings(run, replicas, microbatch, lag_steps), "levels": list(levels),
                         "phases": {"warmup": [0, warmup_steps],
                                    "failure": [warmup_steps, warmup_steps + failure_steps],
                                    "recovery": [warmup_steps + failure_steps, steps]},
                         "failure_model": "each replica of each stage misses each averaging round with probability "
                                          "1 - level: it neither contributes nor receives (keeps its local values)",
                         "probe_samples": probe_samples, "seed": seed},
            "variants": variants, "elapsed_s": round(time.perf_counter() - t_start, 2)}
