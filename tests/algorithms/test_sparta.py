"""Unit tests of the AsyncSPARTA maths (agoractl.algorithms.sparta): in-memory, no network."""

import subprocess
import sys

import torch

from agoractl.algorithms.sparta import SegmentTiling, apply_round, weighted_average
from agoractl.manifest.loader import load_manifest
from tests.conftest import MANIFESTS

SHAPES = {"a.weight": (7, 5), "b.bias": (3,), "c.weight": (4, 4, 2)}


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


def n_segments(fraction: float) -> int:
    """The run's SPARTA segment count (Run.n_segments, the one the tiling uses) at `fraction`."""
    return load_manifest(MANIFESTS / "local-cpu.yaml", [f"data_parallel.sparta.fraction={fraction}"]).n_segments()


def test_n_segments():
    assert n_segments(0.05) == 20
    assert n_segments(1.0) == 1
    assert n_segments(0.3) == 4


def test_segments_tile_every_parameter_exactly_once():
    t = SegmentTiling(SHAPES, segments=4, seed=3)
    for name, shape in SHAPES.items():
        seen = torch.zeros(t.numels[name], dtype=torch.int64)
        for s in range(4):
            seen[t.indices(s)[name]] += 1
        assert torch.equal(seen, torch.ones_like(seen)), name
    sizes = [t.size(s) for s in range(4)]
    assert t.max_size() == max(sizes) == sizes[0]
    assert sum(sizes) == sum(t.numels.values())
    assert max(sizes) - min(sizes) <= len(SHAPES)


def test_tiling_is_identical_across_processes():
    code = (
        "from agoractl.algorithms.sparta import SegmentTiling;"
        "t=SegmentTiling({'a.weight':(7,5),'b.bias':(3,),'c.weight':(4,4,2)},4,3);"
        "print([t.indices(s)[n].tolist() for s in range(4) for n in t.names])"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    t = SegmentTiling(SHAPES, 4, 3)
    assert other == str([t.indices(s)[n].tolist() for s in range(4) for n in t.names])
    assert str([SegmentTiling(SHAPES, 4, 4).indices(0)[n].tolist() for n in t.names]) != str(
        [t.indices(0)[n].tolist() for n in t.names])


def test_gather_and_add_roundtrip():
    t = SegmentTiling(SHAPES, 3, 0)
    p = params()
    before = {n: v.clone() for n, v in p.items()}
    seg = t.gather(p, 1)
    t.add_(p, 1, torch.ones_like(seg))
    assert torch.allclose(t.gather(p, 1), seg + 1)
    for s in (0, 2):
        assert torch.equal(t.gather(p, s), t.gather(before, s))


def test_delta_rule_keeps_local_progress_made_during_the_round():
    t = SegmentTiling(SHAPES, 2, 0)
    replicas = [params(0), params(1)]
    modules = []
    for r in replicas:
        m = torch.nn.ParameterDict({n.replace(".", "_"): torch.nn.Parameter(v) for n, v in r.items()})
        modules.append(m)
    views = [{n: m[n.replace(".", "_")].data for n in SHAPES} for m in modules]
    snaps = [t.gather(v, 0) for v in views]
    avg = weighted_average(snaps, [1, 1])
    # The optimizer steps between snapshot and apply: that progress must survive.
    opt = torch.optim.SGD(modules[0].parameters(), lr=0.1)
    loss = sum((p ** 2).sum() for p in modules[0].parameters())
    loss.backward()
    opt.step()
    progressed = t.gather(views[0], 0)
    apply_round(views[0], t, 0, snaps[0], avg, delta_rule=True)
    assert torch.allclose(t.gather(views[0], 0), progressed + (avg - snaps[0]), atol=1e-6)
    # Replacement loses it: the segment becomes the average exactly.
    apply_round(views[1], t, 0, snaps[1], avg, delta_rule=False)
    assert torch.allclose(t.gather(views[1], 0), avg, atol=1e-6)


def test_weights_by_samples_and_weight_zero_peers_absorb():
    a, b, c = torch.tensor([0.0, 0.0]), torch.tensor([3.0, 6.0]), torch.tensor([100.0, 100.0])
    assert torch.allclose(weighted_average([a, b], [2, 1]), torch.tensor([1.0, 2.0]))
    # c is syncing (weight 0): the others' average does not move, and c receives it.
    assert torch.allclose(weighted_average([a, b, c], [2, 1, 0]), torch.tensor([1.0, 2.0]))
    assert weighted_average([a, b], [0, 0]) is None


def test_values_whose_average_did_not_return_keep_local_values():
    t = SegmentTiling(SHAPES, 2, 0)
    p = params(0)
    snap = t.gather(p, 1)
    avg = snap + 1.0
    mask = torch.arange(snap.numel()) % 2 == 0
    apply_round(p, t, 1, snap, avg, delta_rule=False, averaged=mask)
    got = t.gather(p, 1)
    assert torch.allclose(got[mask], avg[mask]) and torch.equal(got[~mask], snap[~mask])
