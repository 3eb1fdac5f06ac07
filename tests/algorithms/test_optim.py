"""Tests of agoractl.algorithms.optim: AdamW (against torch's), groups, warm-up + cosine schedule, stage-wise clipping.

In-memory, but one test starts a Python process to see what a worker imports.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from agoractl.manifest.loader import load_manifest
from agoractl.model.build import build_stage
from agoractl.algorithms.optim import clip_stage_, lr_at, make_optimizer
from tests.conftest import MANIFESTS

LOCAL = MANIFESTS / "local-cpu.yaml"


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    run = load_manifest(LOCAL, ["training.max_steps=105", "training.schedule.warmup_steps=5",
                                "training.optimizer.lr=1.0", "training.schedule.min_lr_ratio=0.1"])
    assert [lr_at(run, s) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert lr_at(run, 5) == pytest.approx(1.0)
    assert lr_at(run, 55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(run, 105) == pytest.approx(0.1)
    assert lr_at(run, 500) == pytest.approx(0.1)  # past max_steps: stays at the floor
    lrs = [lr_at(run, s) for s in range(5, 106)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_constant_schedule_and_no_warmup():
    run = load_manifest(LOCAL, ["training.schedule.kind=constant", "training.schedule.warmup_steps=0"])
    assert {lr_at(run, s) for s in (0, 10, 10_000)} == {run.training.optimizer.lr}


def test_optimizer_decays_matrices_only_and_starts_at_the_schedule():
    run = load_manifest(LOCAL, [])
    stage = build_stage(run, 2)
    opt = make_optimizer(stage.parameters(), run)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(stage.parameters()))
    assert opt.param_groups[0]["lr"] == lr_at(run, 0)
    assert tuple(opt.defaults["betas"]) == (0.9, 0.95)


def test_clip_stage_returns_the_pre_clip_norm_and_clips_to_the_stage_threshold():
    run = load_manifest(LOCAL, [])
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 3.0), torch.full((4,), 2.0)
    norm = math.sqrt(9 * 3 + 4 * 4)
    threshold = run.clip_threshold(0)
    assert threshold == pytest.approx(1 / math.sqrt(3)) and run.clip_threshold(2) == pytest.approx(2 / math.sqrt(3))
    assert clip_stage_([a, b], threshold) == pytest.approx(norm)
    after = math.sqrt(a.grad.pow(2).sum() + b.grad.pow(2).sum())
    assert after == pytest.approx(threshold, rel=1e-4)
    # None measures without touching; parameters without a gradient are skipped.
    c = torch.nn.Parameter(torch.zeros(2))
    assert clip_stage_([a, b, c], None) == pytest.approx(threshold, rel=1e-4)
    assert clip_stage_([c], 1.0) == 0.0


def _twin_stages(run):
    a, b = build_stage(run, 1), build_stage(run, 1)
    b.load_state_dict(a.state_dict())
    return a, b


def _grads(stage, seed):
    g = torch.Generator().manual_seed(seed)
    for p in stage.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_adamw_matches_torch_bit_for_bit_and_shares_its_state_layout():
    """The same updates as torch.optim.AdamW (CPU), under a changing lr; each loads the other's state."""
    run = load_manifest(LOCAL, [])
    ours_stage, torch_stage = _twin_stages(run)
    ours = make_optimizer(ours_stage.parameters(), run)
    decay = [p for p in torch_stage.parameters() if p.ndim >= 2]
    no_decay = [p for p in torch_stage.parameters() if p.ndim < 2]
    theirs = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                               lr=lr_at(run, 0), betas=(0.9, 0.95), eps=run.training.optimizer.eps)
    for step in range(4):
        for stage, opt in ((ours_stage, ours), (torch_stage, theirs)):
            _grads(stage, step)
            for g in opt.param_groups:
                g["lr"] = lr_at(run, step)
            opt.step()
            opt.zero_grad(set_to_none=True)
    for p, q in zip(ours_stage.parameters(), torch_stage.parameters()):
        assert torch.equal(p, q)
        assert p.grad is None
    mine, torch_sd = ours.state_dict(), theirs.state_dict()
    assert set(mine["state"]) == set(torch_sd["state"]) and len(mine["param_groups"]) == 2
    for i, st in torch_sd["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(mine["state"][i][key], st[key]), (i, key)
    # A checkpoint written with torch's AdamW resumes here, and the other way round.
    fresh = make_optimizer(build_stage(run, 1).parameters(), run)
    fresh.load_state_dict(torch_sd)
    assert fresh.param_groups[0]["lr"] == lr_at(run, 3)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], torch_sd["state"][0]["exp_avg"])
    fresh.state_dict()["state"][0]["exp_avg"].add_(1.0)  # loaded moments are copies, not views of the source
    assert torch.equal(theirs.state_dict()["state"][0]["exp_avg"], torch_sd["state"][0]["exp_avg"])
    back = torch.optim.AdamW([{"params": decay}, {"params": no_decay}], lr=1.0)
    back.load_state_dict(mine)
    assert torch.equal(back.state_dict()["state"][0]["exp_avg_sq"], torch_sd["state"][0]["exp_avg_sq"])


def test_adamw_rejects_a_state_of_another_shape():
    run = load_manifest(LOCAL, [])
    opt = make_optimizer(build_stage(run, 1).parameters(), run)
    other = make_optimizer(build_stage(run, 0).parameters(), run).state_dict()
    other["param_groups"][0]["params"] = other["param_groups"][0]["params"][:-1]
    with pytest.raises(ValueError, match="groups of"):
        opt.load_state_dict(other)


def test_a_worker_process_never_imports_torch_dynamo(tmp_path):
    """torch.optim imports torch._dynamo (seconds of CPU) on first use; the stage's optimizer does not."""
    code = ("import sys; from agoractl.manifest.loader import load_manifest; from agoractl.model.build import "
            "build_stage; from agoractl.algorithms.optim import make_optimizer, clip_stage_; "
            f"run = load_manifest({str(LOCAL)!r}, []); s = build_stage(run, 0); o = make_optimizer(s.parameters(), run); "
            "[setattr(p, 'grad', p.detach().clone()) for p in s.parameters()]; clip_stage_(list(s.parameters()), 0.5); "
            "o.step(); o.zero_grad(); o.load_state_dict(o.state_dict()); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
