"""``analyze divergence``: stream a stage's replica snapshots from the store and measure how far the
replicas drifted apart (report §5.7.2; seed 002 for the JS distance).

For every snapshot step: the inter-replica population variance averaged within each SPARTA segment
(the runtime's own tiling, :class:`agoractl.algorithms.sparta.SegmentTiling`, from the manifest), the
movement of the consensus mean since the previous analysed step, the mean and max pairwise L2
distance, and the JS distance of next-token distributions between replicas
(:mod:`agoractl.ops.predictions`).

Memory: the statistics pass reads the same element range (``chunk_elements``) of one parameter
from every replica side by side, so it holds R x chunk values plus the consensus mean of this step
and of the previous one (float64); the JS pass holds one replica's state at a time plus the
assembled model. The maths is in :mod:`agoractl.ops.divergence`; this module only reads and
arranges.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Optional

import torch

from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.schema import Run
from agoractl.ops.checkpoint import CheckpointStore
from agoractl.ops.tensor_file import TensorFile
from agoractl.ops.divergence import StepStatistics, recency_correlation
from agoractl.algorithms.sparta import SegmentTiling

CHUNK_ELEMENTS = 1 << 21
"""Elements of one parameter read from every replica at once (R x 2M x 8 bytes of float64)."""
LAST_SEGMENT_KEY = "last_averaged_segment"
"""Snapshot metadata key the runtime may set: the SPARTA segment of the last round it applied."""


def stage_shapes(run: Run, index: int) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the stage's trainable parameters in ``named_parameters()`` order (meta device)."""
    from agoractl.model.build import build_stage

    return {n: tuple(p.shape) for n, p in build_stage(run, index, "meta").named_parameters()}


def parse_steps(text: Optional[str], available: list[int]) -> list[int]:
    """``--steps``: comma-separated steps and inclusive ranges ``A:B``; None = every available step."""
    if not text:
        return list(available)
    chosen: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            if ":" in part:
                lo, hi = (int(x) if x else None for x in part.split(":", 1))
                chosen.update(s for s in available if (lo is None or s >= lo) and (hi is None or s <= hi))
            else:
                step = int(part)
                if step not in available:
                    raise UsageError(f"--steps: no snapshots at step {step}; snapshot steps are "
                                     f"{', '.join(map(str, available))}")
                chosen.add(step)
        except ValueError:
            raise UsageError(f"--steps: {part!r} is not a step or a range A:B") from None
    if not chosen:
        raise UsageError(f"--steps {text}: selects no snapshot step; snapshot steps are "
                         f"{', '.join(map(str, available))}")
    return sorted(chosen)


def _check_layout(tf: TensorFile, shapes: dict[str, tuple[int, ...]], url: str, stage: str) -> None:
    names = set(tf.entries)
    missing, extra = [n for n in shapes if n not in names], sorted(names - set(shapes))
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise RuntimeFailure(f"{url}: does not match stage {stage} of the manifest ({what}; "
                             f"{len(missing)} missing, {len(extra)} unexpected)",
                             hint="analyse with the manifest the run was started from")
    for n, shape in shapes.items():
        if tf.entries[n].shape != tuple(shape):
            raise RuntimeFailure(f"{url}: tensor {n} has shape {list(tf.entries[n].shape)}; stage {stage} "
                                 f"has {list(shape)}", hint="analyse with the manifest the run was started from")


def step_statistics(store: CheckpointStore, stage: str, step: int, shapes: dict[str, tuple[int, ...]],
                    tiling: SegmentTiling, previous_mean: Optional[dict[str, torch.Tensor]],
                    chunk_elements: int = CHUNK_ELEMENTS) -> tuple[StepStatistics, dict[str, torch.Tensor], dict]:
    """The statistics of one step, its consensus mean (float64, per parameter), and facts about the
    snapshots read (replicas, bytes, last averaged segment)."""
    replicas = store.snapshot_replicas(stage, step)
    if not replicas:
        raise RuntimeFailure(f"{store.url}: no replica snapshots of stage {stage} at step {step}")
    files = []
    try:
        for r in replicas:
            files.append(store.open_snapshot(stage, step, r))
            _check_layout(files[-1], shapes, store.snapshot_url(stage, step, r), stage)
        stats = StepStatistics(len(files), tiling.segments)
        mean: dict[str, torch.Tensor] = {}
        largest = max(e.numel for e in files[0].entries.values())
        # One reusable float64 read buffer: fresh R x n allocations cost more than the maths.
        buffer = torch.empty(len(files), min(chunk_elements, largest), dtype=torch.float64)
        # File order (sorted by offset) makes every replica's reads sequential.
        for name in files[0].entries:
            numel = files[0].entries[name].numel
            out = torch.empty(numel, dtype=torch.float64)
            ids = tiling.ids[name]
            for lo in range(0, numel, chunk_elements):
                hi = min(numel, lo + chunk_elements)
                block = buffer[:, : hi - lo]
                for row, f in zip(block, files):
                    row.copy_(f.read(name, lo, hi))
                prev = previous_mean[name][lo:hi] if previous_mean is not None else None
                out[lo:hi] = stats.add(block, ids[lo:hi], prev, scratch=True)
            mean[name] = out
        last = Counter(f.metadata[LAST_SEGMENT_KEY] for f in files if LAST_SEGMENT_KEY in f.metadata)
        facts = {"replicas": replicas, "bytes": sum(f.size for f in files),
                 "last_averaged_segment": int(last.most_common(1)[0][0]) if last else None}
    finally:
        for f in files:
            f.close()
    return stats, mean, facts


def analyze_divergence(run: Run, stage: str, steps: Optional[str] = None, probe: Optional[str] = None,
                       probe_batch: int = 8, js: bool = True, device: str = "cpu",
                       chunk_elements: int = CHUNK_ELEMENTS, store: Optional[CheckpointStore] = None,
                       progress: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """The whole analysis of `stage` as a JSON-able dict (keys: stage, steps, segment_variance,
    consensus_movement, l2_mean, js_mean, js_max, and more)."""
    try:
        index, _ = run.stage(stage)
    except KeyError as e:
        raise UsageError(f"--stage: {e.args[0]}") from None
    store = store or CheckpointStore(run)
    available = store.snapshot_steps(stage)
    if not available:
        raise RuntimeFailure(f"{store.url}: no replica snapshots of stage {stage}",
                             hint="set checkpoints.snapshots_every_steps in the manifest and run the swarm")
    chosen = parse_steps(steps, available)
    shapes = stage_shapes(run, index)
    tiling = SegmentTiling(shapes, run.n_segments(), run.data_parallel.sparta.seed)
    t0 = time.monotonic()
    out: dict[str, Any] = {
        "stage": stage, "store": store.url, "segments": tiling.segments, "parameters": sum(tiling.numels.values()),
        "steps": chosen, "replicas": {}, "segment_variance": {}, "variance": {}, "consensus_movement": {},
        "l2_mean": {}, "l2_max": {}, "js_mean": {}, "js_max": {}, "js_pairs": {}, "js_context": {},
        "last_averaged_segment": {}, "recency_correlation": {}, "probe": None, "bytes_read": 0,
    }
    previous = None
    for step in chosen:
        stats, mean, facts = step_statistics(store, stage, step, shapes, tiling, previous, chunk_elements)
        previous = mean
        key = str(step)
        seg = stats.segment_variance()
        out["replicas"][key] = facts["replicas"]
        out["segment_variance"][key] = seg
        out["variance"][key] = stats.mean_variance()
        out["consensus_movement"][key] = stats.consensus_movement()
        out["l2_mean"][key], out["l2_max"][key] = stats.l2_mean(), stats.l2_max()
        out["last_averaged_segment"][key] = facts["last_averaged_segment"]
        out["recency_correlation"][key] = (recency_correlation(seg, facts["last_averaged_segment"])
                                           if facts["last_averaged_segment"] is not None else None)
        out["bytes_read"] += facts["bytes"]
        if progress:
            progress(f"step {step}: {len(facts['replicas'])} replicas, mean variance {stats.mean_variance():.3e}")
    del previous
    if js:
        _add_js(run, index, store, chosen, probe, probe_batch, device, out, progress)
    else:
        for step in chosen:
            out["js_mean"][str(step)] = out["js_max"][str(step)] = None
    out["elapsed_s"] = round(time.monotonic() - t0, 3)
    return out


def _add_js(run: Run, index: int, store: CheckpointStore, steps: list[int], probe: Optional[str],
            probe_batch: int, device: str, out: dict[str, Any], progress) -> None:
    from agoractl.ops.predictions import AssembledModel, js_between_replicas, probe_batch as make_probe

    tokens, source = make_probe(run, probe, probe_batch)
    out["probe"] = source
    model = AssembledModel(run, index, store, device)
    for step in steps:
        key = str(step)
        out["js_context"][key] = model.set_context(step)
        names, logprobs = [], []
        for replica, lp in model.replica_logprobs(step, tokens):
            names.append(replica)
            logprobs.append(lp)
        js = js_between_replicas(logprobs)
        out["js_mean"][key], out["js_max"][key] = js["mean"], js["max"]
        out["js_pairs"][key] = {"replicas": names, "matrix": js["matrix"]}
        if progress:
            progress(f"step {step}: JS distance mean {js['mean'] or 0:.3e}, max {js['max'] or 0:.3e} "
                     f"over {len(names)} replicas")
