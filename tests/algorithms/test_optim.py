"""Tests of agoractl.algorithms.optim: torch's AdamW (kernel, groups, checkpoints of the hand-written
AdamW it replaced), warm-up + cosine schedule, stage-wise clipping, the stage's optimizer step.

In-memory, but one test starts a Python process to see what an optimizer step imports. The fixture
tests/algorithms/fixtures/handwritten-adamw was written by commit 5399971 (agoractl 0.1.0, the
hand-written AdamW): a checkpoint of a tiny body stage (``TINY``) after 3 steps on ``_grads(stage, 0..2)``
with lr ``lr_at(run, step)``, and the parameters after a 4th step on ``_grads(stage, 3)``.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from agoractl.manifest.loader import load_manifest
from agoractl.model.build import build_stage
from agoractl.algorithms.optim import clip_stage_, lr_at, make_optimizer, optimizer_step
from agoractl.ops.checkpoint import CheckpointStore
from tests.conftest import MANIFESTS

LOCAL = MANIFESTS / "local-cpu.yaml"
FIXTURE = Path(__file__).parent / "fixtures" / "handwritten-adamw"
TINY = ["model.d_model=32", "model.d_ff=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ssn.rank=8",
        "training.schedule.warmup_steps=2"]


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


def _grads(stage, seed):
    g = torch.Generator().manual_seed(seed)
    for p in stage.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_the_optimizer_is_torchs_adamw_with_the_fused_kernel_on_cpu():
    run = load_manifest(LOCAL, [])
    opt = make_optimizer(build_stage(run, 1).parameters(), run)
    assert type(opt) is torch.optim.AdamW
    assert all(g["fused"] for g in opt.param_groups)  # torch >= 2.4 has a fused AdamW for the CPU


def test_a_checkpoint_of_the_handwritten_adamw_loads_and_training_goes_on():
    """The fixture's moments and hyper-parameters load into torch's AdamW, which keeps its kernel, and the
    next step lands where the hand-written AdamW's did (float rounding apart)."""
    run = load_manifest(LOCAL, TINY)
    stage = build_stage(run, 1)
    opt = make_optimizer(stage.parameters(), run)
    checkpoint = CheckpointStore(str(FIXTURE)).load("body")
    assert checkpoint.apply_to(stage, opt) == 3
    assert all(g["fused"] and g["decoupled_weight_decay"] for g in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    first = opt.state[opt.param_groups[0]["params"][0]]
    assert float(first["step"]) == 3.0
    torch.testing.assert_close(first["exp_avg"], checkpoint.optimizer_state["state"][0]["exp_avg"], rtol=0, atol=0)
    _grads(stage, 3)
    for g in opt.param_groups:
        g["lr"] = lr_at(run, 3)
    opt.step()
    expected = safetensors.torch.load_file(str(FIXTURE / "after-step-4.safetensors"))
    for name, value in stage.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7, msg=name)
    # And the state written now has the same layout: it loads into a fresh optimizer.
    again = make_optimizer(build_stage(run, 1).parameters(), run)
    again.load_state_dict(opt.state_dict())
    assert float(again.state[again.param_groups[1]["params"][0]]["step"]) == 4.0


def test_adamw_rejects_a_state_of_another_shape():
    run = load_manifest(LOCAL, [])
    opt = make_optimizer(build_stage(run, 1).parameters(), run)
    other = make_optimizer(build_stage(run, 0).parameters(), run).state_dict()
    other["param_groups"][0]["params"] = other["param_groups"][0]["params"][:-1]
    with pytest.raises(ValueError, match="group that doesn't match the size"):
        opt.load_state_dict(other)


def test_torch_dynamo_is_imported_once_when_the_optimizer_is_built_and_never_by_a_step(tmp_path):
    """torch.optim imports torch._dynamo (seconds of CPU): that happens while a node starts (building
    its optimizer), never in the middle of training. After the first optimizer exists, stepping,
    zeroing, saving and loading its state import none of the compiler's modules (torch._dynamo,
    torch._inductor, torch.fx, sympy; a step may still load a small profiler module)."""
    code = ("import sys; from agoractl.manifest.loader import load_manifest; from agoractl.model.build import "
            "build_stage; from agoractl.algorithms.optim import make_optimizer, optimizer_step, lr_at; "
            f"run = load_manifest({str(LOCAL)!r}, []); s = build_stage(run, 0); "
            "before = 'torch._dynamo' in sys.modules; o = make_optimizer(s.parameters(), run); "
            "built = set(sys.modules); "
            "[setattr(p, 'grad', p.detach().clone()) for p in s.parameters()]; "
            "optimizer_step(o, [(list(s.parameters()), 0.5)], lr_at(run, 0), samples=2); "
            "o.load_state_dict(o.state_dict()); o.zero_grad(); "
            "compiler = ('torch._dynamo', 'torch._inductor', 'torch.fx', 'sympy'); "
            "print(before, 'torch._dynamo' in built, [m for m in set(sys.modules) - built if m.startswith(compiler)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False True []"


def _param(*values):
    p = torch.nn.Parameter(torch.tensor(values))
    p.grad = torch.ones_like(p) * 4.0
    return p


def test_optimizer_step_divides_by_samples_clips_each_group_sets_lr_and_drops_the_gradients():
    a, b = _param(1.0, 2.0), _param(3.0)
    opt = torch.optim.AdamW([a, b], lr=1.0, weight_decay=0.0)
    result = optimizer_step(opt, [([a], 1.0), ([b], None)], 0.5, samples=2)
    # gradients /2 -> (2, 2) and (2,): norms sqrt(8) and 2; the first clipped, the second only measured
    assert result.stepped and result.norms == pytest.approx([math.sqrt(8), 2.0])
    assert opt.param_groups[0]["lr"] == 0.5 and a.grad is None and b.grad is None
    # Adam's first step moves each coordinate by lr, whatever the gradient's scale
    assert a.tolist() == pytest.approx([0.5, 1.5]) and b.tolist() == pytest.approx([2.5])


def test_optimizer_step_skips_a_non_finite_step_but_still_drops_the_gradients():
    a = _param(1.0, 2.0)
    a.grad[0] = float("inf")
    opt = torch.optim.AdamW([a], lr=1.0)
    result = optimizer_step(opt, [([a], 1.0)], 0.5)
    assert not result.stepped and not math.isfinite(result.norms[0])
    assert a.tolist() == [1.0, 2.0] and a.grad is None and not opt.state


def test_optimizer_step_steps_master_weights_and_copies_them_to_the_compute_copies():
    compute = [_param(1.0, 2.0)]
    master = [torch.nn.Parameter(compute[0].detach().clone())]
    opt = torch.optim.AdamW(master, lr=1.0, weight_decay=0.0)
    optimizer_step(opt, [(compute, None)], 0.25, master=master)
    assert master[0].tolist() == pytest.approx([0.75, 1.75]) and torch.equal(compute[0], master[0])
    assert compute[0].grad is None and master[0].grad is None
