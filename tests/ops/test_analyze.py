"""Tests of ``analyze divergence`` (agoractl.ops.analyze) on synthetic replica snapshots written to a
real store: per-segment variances known by construction (to 1e-6 relative), consensus movement,
pairwise L2, streaming in small chunks, and the JS distance of the assembled model (identical
replicas 0; replicas differing in one stage > 0, growing with the difference). Local files; the
tiny local-cpu model."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.loader import load_manifest
from agoractl.ops.analyze import analyze_divergence, parse_steps, stage_shapes
from agoractl.ops.checkpoint import CheckpointStore
from agoractl.model.build import build_stage
from agoractl.algorithms.sparta import SegmentTiling
from tests.conftest import MANIFESTS

torch.set_num_threads(1)
R = 4
# Every distinct arrangement of two +1 and two -1: mean 0 and population variance exactly 1.
PATTERNS = torch.tensor(sorted(set(itertools.permutations([1.0, 1.0, -1.0, -1.0]))), dtype=torch.float64)


def _run(tmp_path, *extra):
    return load_manifest(MANIFESTS / "local-cpu.yaml",
                         [f"checkpoints.store={tmp_path}/store", f"data.output={tmp_path}/no-shards", *extra])


def _synthetic(run, index, scale: float, shift: bool, seed: int = 0):
    """R replicas of stage `index` whose values are exact in fp32: base + sigma_s * c * z, with
    sigma_s = 2^-(4 + s mod 8) per segment s, c in {0.5, 1, 2} and z a ±1 pattern across replicas.
    Returns the replicas, the expected per-segment variances and pairwise distances, and the
    expected consensus movement relative to the same construction without `shift`."""
    g = torch.Generator().manual_seed(seed)
    shapes = stage_shapes(run, index)
    tiling = SegmentTiling(shapes, run.n_segments(), run.data_parallel.sparta.seed)
    sigma = torch.tensor([2.0 ** -(4 + s % 8) for s in range(tiling.segments)], dtype=torch.float64) * scale
    replicas = [{} for _ in range(R)]
    var_sum = torch.zeros(tiling.segments, dtype=torch.float64)
    count = torch.zeros(tiling.segments, dtype=torch.float64)
    sq_dist = torch.zeros(R, R, dtype=torch.float64)
    move_sq, elements = 0.0, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        ids = tiling.ids[name].long()
        base = torch.round(torch.randn(n, generator=g, dtype=torch.float64) * 64) / 64
        delta = (torch.randint(0, 2, (n,), generator=g) * 2 - 1).double() / 128
        c = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)[torch.randint(0, 3, (n,), generator=g)]
        z = PATTERNS[torch.randint(0, len(PATTERNS), (n,), generator=g)]
        amp = sigma[ids] * c
        values = (base + (delta if shift else 0))[:, None] + amp[:, None] * z
        for r in range(R):
            replicas[r][name] = values[:, r].float().reshape(shape)
        assert torch.equal(values.float().double(), values)  # exact in fp32 by construction
        var_sum += torch.bincount(ids, weights=amp ** 2, minlength=tiling.segments)
        count += torch.bincount(ids, minlength=tiling.segments).double()
        sq_dist += ((amp[:, None, None] * (z[:, :, None] - z[:, None, :])) ** 2).sum(0)
        move_sq += float((delta ** 2).sum())
        elements += n
    pairs = [float(sq_dist[i, j].sqrt()) for i, j in itertools.combinations(range(R), 2)]
    return replicas, (var_sum / count).tolist(), pairs, move_sq / elements


def test_known_segment_variances_movement_and_l2(tmp_path):
    run = _run(tmp_path)
    store = CheckpointStore(run)
    first, var1, pairs1, _ = _synthetic(run, 0, 1.0, shift=False)
    second, var2, pairs2, movement = _synthetic(run, 0, 2.0, shift=True)
    for step, reps in ((100, first), (200, second)):
        for r, state in enumerate(reps):
            store.save_snapshot("head", step, f"worker-{r}", state, meta={"last_averaged_segment": 7})
    for chunk in (1 << 21, 997):  # whole tensors at once, and many small side-by-side reads
        out = analyze_divergence(run, "head", js=False, chunk_elements=chunk)
        assert out["stage"] == "head" and out["steps"] == [100, 200] and out["segments"] == 20
        np.testing.assert_allclose(out["segment_variance"]["100"], var1, rtol=1e-6)
        np.testing.assert_allclose(out["segment_variance"]["200"], var2, rtol=1e-6)
        assert out["consensus_movement"]["100"] is None
        assert out["consensus_movement"]["200"] == pytest.approx(movement, rel=1e-6)
        assert out["l2_mean"]["100"] == pytest.approx(np.mean(pairs1), rel=1e-6)
        assert out["l2_max"]["200"] == pytest.approx(np.max(pairs2), rel=1e-6)
        assert out["replicas"]["200"] == [f"worker-{r}" for r in range(R)]
        assert out["last_averaged_segment"]["100"] == 7
        assert out["js_mean"] == {"100": None, "200": None}
        assert out["bytes_read"] > 2 * R * 4 * out["parameters"]
    assert analyze_divergence(run, "head", steps="150:", js=False)["steps"] == [200]


def _identical_and_noisy(run, store, noisy_stage: int, eps: dict[int, float]):
    """Snapshots of every stage at each step of `eps`: replicas identical except in `noisy_stage`,
    whose replicas get independent noise of scale eps[step]."""
    for i, name in enumerate(run.stage_names()):
        base = build_stage(run, i).state_dict()
        for step, e in eps.items():
            for r in range(3):
                g = torch.Generator().manual_seed(1000 * r + step)
                state = {k: v + (e * torch.randn(v.shape, generator=g) if i == noisy_stage else 0)
                         for k, v in base.items()}
                store.save_snapshot(name, step, f"r{r}", state)


def test_js_distance_zero_for_identical_and_grows_with_difference(tmp_path):
    run = _run(tmp_path)
    store = CheckpointStore(run)
    _identical_and_noisy(run, store, noisy_stage=1, eps={10: 0.01, 20: 0.05})
    body = analyze_divergence(run, "body-1")
    assert 0 < body["js_mean"]["10"] <= body["js_max"]["10"]
    assert body["js_mean"]["20"] > body["js_mean"]["10"]
    assert body["js_max"]["20"] > body["js_max"]["10"]
    assert body["probe"]["kind"] == "random" and "no shard index" in body["probe"]["reason"]
    assert body["js_context"]["10"] == {"head": "consensus mean of 3 snapshot(s) at step 10",
                                        "tail": "consensus mean of 3 snapshot(s) at step 10"}
    head = analyze_divergence(run, "head")
    assert head["js_mean"] == {"10": 0.0, "20": 0.0} and head["js_max"] == {"10": 0.0, "20": 0.0}
    assert head["segment_variance"]["10"] == [0.0] * 20


def test_js_context_falls_back_to_checkpoint_then_init(tmp_path):
    run = _run(tmp_path)
    store = CheckpointStore(run)
    base = build_stage(run, 0).state_dict()
    for r in range(2):
        store.save_snapshot("head", 30, f"r{r}", {k: v + 0.01 * r for k, v in base.items()})
    store.publish("tail", 25, build_stage(run, 2).state_dict(), None, {})
    out = analyze_divergence(run, "head", probe_batch=2)
    assert out["js_context"]["30"]["tail"] == "checkpoint at step 25"
    assert out["js_context"]["30"]["body-1"].startswith("initialisation")
    assert out["js_mean"]["30"] > 0 and out["probe"]["sequences"] == 2


def test_bad_requests(tmp_path):
    run = _run(tmp_path)
    with pytest.raises(UsageError, match="no stage 'nope'"):
        analyze_divergence(run, "nope")
    with pytest.raises(RuntimeFailure, match="no replica snapshots of stage head"):
        analyze_divergence(run, "head")
    CheckpointStore(run).save_snapshot("head", 5, "r0", {"not.a.parameter": torch.zeros(3)})
    with pytest.raises(RuntimeFailure, match="does not match stage head"):
        analyze_divergence(run, "head", js=False)
    assert parse_steps("5,20:30", [5, 10, 20, 30, 40]) == [5, 20, 30]
    with pytest.raises(UsageError, match="no snapshots at step 7"):
        parse_steps("7", [5, 10])
    with pytest.raises(UsageError, match="not a step"):
        parse_steps("x", [5])


def test_sparta_simulation_shows_linear_in_recency(tmp_path):
    """Replicas trained with the real AsyncSPARTA code (the in-process pipeline simulator: stage
    modules, AdamW, segment tiling, delta rule) drift apart; at every snapshot step the segment
    averaged most recently has the lowest variance and variance grows with rounds since averaging."""
    from agoractl.sim.simulator import Batcher, PipelineSim, lesson_sequences

    every, segments = 2, 4
    run = _run(tmp_path, f"data_parallel.sparta.fraction={1 / segments}", f"data_parallel.sparta.every_steps={every}",
               "model.seq_len=32", "training.global_batch_size=8")
    store = CheckpointStore(run)
    sim = PipelineSim(run, 2, lag_steps=1)
    batches = Batcher(lesson_sequences(run))
    last_applied = {}
    for step in range(1, 25):
        sim.train_step(batches.take(8), 4)
        if step % 6 == 0:
            # Round r starts at step every*(r+1) on segment r mod S and is applied one step later, so
            # the round started at this step is still pending: the last applied one started 2 steps ago.
            last_applied[step] = ((step - every) // every - 1) % segments
            for j, rep in enumerate(sim.stages[0]):
                store.save_snapshot("head", step, f"r{j}", {k: v.detach() for k, v in rep.params.items()},
                                    meta={"last_averaged_segment": last_applied[step]})
    out = analyze_divergence(run, "head", js=False)
    assert out["steps"] == [6, 12, 18, 24] and sorted(set(last_applied.values())) == [0, 1, 2, 3]
    for step in map(str, out["steps"]):
        variances = out["segment_variance"][step]
        assert out["last_averaged_segment"][step] == last_applied[int(step)]
        assert min(range(segments), key=lambda s: variances[s]) == last_applied[int(step)], variances
        assert out["recency_correlation"][step] > 0.8, variances


def test_probe_batch_sources(tmp_path):
    """The default probe is the run's first shard sequences (real shards written by `shard`); a text
    file is tokenized with the manifest's tokenizer; without either, seeded random tokens."""
    from agoractl.data.sample import write_sample
    from agoractl.data.shard import reshard
    from agoractl.data.stream import run_sequences
    from agoractl.ops.predictions import probe_batch

    run = _run(tmp_path, f"data.source={tmp_path}/sample/*.parquet", f"data.output={tmp_path}/shards",
               "data.num_shards=2")
    tokens, source = probe_batch(run, batch=3)
    assert source["kind"] == "random" and "no shard index" in source["reason"]
    assert torch.equal(tokens, probe_batch(run, batch=3)[0])  # fixed: the same batch every time
    write_sample(str(tmp_path / "sample"), rows=300, files=1)
    reshard(run, jobs=1)
    tokens, source = probe_batch(run, batch=3)
    assert source == {"kind": "shards", "output": f"{tmp_path}/shards", "sequences": 3, "tokens": 128}
    stream = run_sequences(run)
    assert torch.equal(tokens, torch.stack([next(stream)[:128] for _ in range(3)]))
    (tmp_path / "probe.txt").write_text("héllo")
    tokens, source = probe_batch(run, str(tmp_path / "probe.txt"), batch=3)
    assert tokens.tolist() == [[104, 195, 169, 108, 108, 111, 256]] and source["kind"] == "file"


def test_reads_snapshots_from_s3_in_ranges(tmp_path, s3_env):
    """The same analysis over a bucket on the loopback moto_server (ranged GETs through s3fs)."""
    bucket = s3_env["make_bucket"]("analyze-snapshots")
    runs = {"local": _run(tmp_path), "s3": _run(tmp_path, f"checkpoints.store={bucket}/run")}
    replicas, variances, _, _ = _synthetic(runs["local"], 0, 1.0, shift=False)
    for run in runs.values():
        store = CheckpointStore(run)
        for r, state in enumerate(replicas[:2]):
            store.save_snapshot("head", 10, f"w{r}", state)
    local, remote = (analyze_divergence(runs[k], "head", js=False, chunk_elements=5000) for k in ("local", "s3"))
    assert remote["store"] == f"{bucket}/run" and remote["bytes_read"] == local["bytes_read"]
    assert remote["segment_variance"] == local["segment_variance"] and remote["l2_mean"] == local["l2_mean"]
