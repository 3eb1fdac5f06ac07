"""The swarm's run report, aggregated from its nodes' statistics (same format as ``launch central``).

Inputs are the final stats every worker and trainer writes on exit (:mod:`agoractl.runtime.worker_node`,
:mod:`agoractl.runtime.trainer`), typed by :mod:`agoractl.training.node_stats`, and for a node killed
before it could write them (SIGKILL), what the swarm last saw of it in the DHT. Pure: stats in, dict out.

- ``steps``: the optimizer steps every stage completed (the slowest stage's count);
  ``tokens`` = steps x global batch x seq_len, as the central reference counts them.
- ``elapsed_s``: from the first sample any trainer dispatched to the moment the last stage took its
  final step, so ``tokens_per_s`` is the pipeline throughput of report §5.4.0.1,
  B·L / t_optim_step, averaged over the run (start-up of processes is not counted, as the
  central reference does not count building its model).
- ``loss``: [step, mean loss of the samples the tail counted toward that step], merged over trainers;
  ``step_samples``: how many samples those were, {min, max, mean} over the steps (exactly the global batch
  in every step where replicas step on their own counts, ``data_parallel.fgdiloco.replicas``).
- ``startup_s``: from the launcher's start (the ``agoractl launch swarm`` process) to the first optimizer step
  any worker took.
- ``samples_lost``: samples trainers gave up on, plus the in-flight samples of trainers that died.
- ``stages[]``: per stage ``workers_seen``, ``samples`` (backward passes served), ``max_coalesced``
  and ``mean_coalesced``, ``retries``, ``bans``, ``rejected`` (replies rejected as invalid) and
  ``backward_fallbacks`` (summed over trainers); where replicas step on their own counts, ``route_fallbacks``
  (requests not trained by the replica :class:`~agoractl.algorithms.routing.ReplicaRoute` assigned them).
- ``faults``: per worker whose replies were rejected, its stage, the count per reason (summed over
  trainers) and how many trainers rejected it (:mod:`agoractl.algorithms.validation`).
"""

from __future__ import annotations

from typing import Any, Optional

from agoractl.manifest.schema import Run
from agoractl.training.node_stats import LostTrainer, TrainerNodeStats, WorkerNodeStats, summary
from agoractl.training.report import run_report


def _stage_completion(workers: list[WorkerNodeStats], stage: str, step_index: int) -> Optional[float]:
    """Wall time at which the first replica of `stage` took optimizer step `step_index` (0-based)."""
    times = [t for w in workers if w.stage == stage for s, t, *_ in w.steps if s == step_index]
    return min(times) if times else None


def _averaging(workers: list[WorkerNodeStats]) -> dict[str, Any]:
    """A stage's SPARTA health from its workers' round records (report §5.7.1)."""
    # Here, not at the top: the sparta module imports torch, which `launch swarm` would then import before it
    # starts the DHT seed (node_process.warm imports it afterwards, while the seed starts).
    from agoractl.algorithms.sparta import round_summary

    return round_summary([r for w in workers for r in w.rounds])


def _outer_rounds(workers: list[WorkerNodeStats]) -> dict[str, Any]:
    """A stage's FGDiLoCo health: outer rounds completed and the success of Mix1 and Mix2 (mixes
    that ran; 'none' mixing and lone replicas skip theirs)."""
    ran = [r for w in workers for r in w.rounds if r.get("status") not in (None, "skipped")]
    out: dict[str, Any] = {"outer_rounds": max([0, *(int((w.fgdiloco or {}).get("outer_rounds", 0)) for w in workers)])}
    for mix in ("mix1", "mix2"):
        xs = [float(r.get("averaging_success", 0.0)) for r in ran if r.get("mix") == mix]
        out[f"{mix}_success_mean"] = sum(xs) / len(xs) if xs else None
    return out


def _mean_coalesced(workers: list[WorkerNodeStats]) -> Optional[float]:
    """Samples per compute pass over a stage's workers (report §5.4.0.4: near 1 when the stage is starved,
    near the cap when work piles up); None when unknown (only killed workers' records)."""
    samples = sum(w.coalesced_sum for w in workers)
    passes = sum(sum(w.batches.values()) for w in workers)
    return round(samples / passes, 2) if passes else None


def stage_steps(workers: list[WorkerNodeStats], stage: str) -> int:
    return max([0, *(w.step for w in workers if w.stage == stage)])


def merge_faults(trainers: list[TrainerNodeStats]) -> dict[str, dict]:
    """{worker peer: {"stage", reason: count..., "trainers": how many trainers rejected it}}."""
    out: dict[str, dict] = {}
    for t in trainers:
        for peer, counts in t.faults.items():
            entry = out.setdefault(peer, {"stage": counts.get("stage"), "trainers": 0})
            entry["trainers"] += 1
            for reason, n in counts.items():
                if reason != "stage":
                    entry[reason] = entry.get(reason, 0) + int(n)
    return out


def aggregate(run: Run, worker_stats: list[WorkerNodeStats], trainer_stats: list[TrainerNodeStats],
              lost_trainers: list[LostTrainer], fallback_elapsed_s: float, launched: Optional[float] = None,
              **extra: Any) -> dict[str, Any]:
    """The run report of a swarm run; it lists every node's :func:`~agoractl.training.node_stats.summary`.

    :param worker_stats: per worker its final stats, or for a killed one what its last DHT record
                    says (``killed``: stage, step, backward samples, max_coalesced)
    :param trainer_stats: final stats of the trainers that wrote them
    :param lost_trainers: trainers that died without stats
    :param fallback_elapsed_s: wall time of training as the swarm saw it, used when step times are missing
    :param launched: wall time the launcher started (``startup_s`` counts from it to the first optimizer step)
    """
    workers, trainers = worker_stats, trainer_stats
    stages = run.stage_names()
    batch, seq_len = run.training.global_batch_size, run.model.seq_len
    steps = min(stage_steps(workers, s) for s in stages) if workers else 0
    starts = [t.first_dispatch for t in trainers if t.first_dispatch]
    ends = [_stage_completion(workers, s, steps - 1) for s in stages] if steps else []
    if starts and ends and all(e is not None for e in ends):
        elapsed = max(ends) - min(starts)
    else:
        elapsed = fallback_elapsed_s
    merged: dict[int, list[float]] = {}
    for t in trainers:
        for step, (total, count) in t.loss.items():
            m = merged.setdefault(int(step), [0.0, 0])
            m[0] += total
            m[1] += count
    loss = [[s, m[0] / m[1]] for s, m in sorted(merged.items()) if m[1] and s < max(steps, 1)]
    counts = [merged[s][1] for s, _ in loss]
    step_samples = {"min": min(counts), "max": max(counts), "mean": round(sum(counts) / len(counts), 3)} \
        if counts else None
    first_step = min((w.steps[0][1] for w in workers if w.steps), default=None)
    startup = round(first_step - launched, 3) if first_step is not None and launched is not None else None
    lost = sum(t.lost for t in trainers) + sum(t.in_flight for t in lost_trainers)
    per_stage = []
    for s in stages:
        mine = [w for w in workers if w.stage == s]
        seen = {w.peer for w in mine if w.peer}
        counters = [t.stages[s] for t in trainers if s in t.stages]
        for c in counters:
            seen.update(c.workers_seen)
        per_stage.append({
            "name": s,
            "workers_seen": len(seen),
            "steps": stage_steps(workers, s),
            "samples": sum(w.backward_samples for w in mine),
            "max_coalesced": max([0, *(w.max_coalesced for w in mine)]),
            "mean_coalesced": _mean_coalesced(mine),
            "retries": sum(c.retries for c in counters),
            "bans": sum(c.bans for c in counters),
            "rejected": sum(c.rejected for c in counters),
            "backward_fallbacks": sum(c.backward_fallbacks for c in counters),
            **(_averaging(mine) if run.data_parallel.method == "sparta" else {}),
            **(_outer_rounds(mine) if run.data_parallel.method == "fgdiloco" else {}),
            **({"route_fallbacks": sum(c.route_fallbacks for c in counters)} if run.replica_batch else {}),
        })
    return run_report(
        mode="swarm", name=run.metadata.name, steps=steps, tokens=steps * batch * seq_len,
        elapsed_s=max(elapsed, 1e-9), loss=loss, step_samples=step_samples, startup_s=startup,
        samples_lost=lost,
        samples_dispatched=sum(t.dispatched for t in trainers),
        samples_completed=sum(t.completed for t in trainers),
        stages=per_stage, global_batch_size=batch, seq_len=seq_len, max_steps=run.training.max_steps,
        until_step=run.training.until_step, completed=steps >= run.training.stop_step, faults=merge_faults(trainers),
        workers=[summary(w) for w in workers], trainers=[summary(t) for t in trainers],
        **extra,
    )
