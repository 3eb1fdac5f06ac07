"""Tests of agoractl.runtime.optim: AdamW groups, warm-up + cosine schedule, stage-wise clipping. In-memory."""

from __future__ import annotations

import math

import pytest
import torch

from agoractl.manifest.loader import load_manifest
from agoractl.runtime.model import build_stage
from agoractl.runtime.optim import clip_stage_, lr_at, make_optimizer
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
