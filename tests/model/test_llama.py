"""Tests of agoractl.model.llama: stage partition vs the monolithic model, initialisation by name,
parameter counts vs ``manifest plan`` (on the meta device), the SSN invariant. In-process, CPU, no network."""

from __future__ import annotations

import pytest
import torch

from agoractl.manifest.loader import load_manifest
from agoractl.manifest.plan import stage_counts
from agoractl.model.build import build_model, build_stage, model_stage_counts, stage_parameter_names
from agoractl.model.llama import LlamaStage, StageModule, lm_loss, split_sample
from tests.conftest import MANIFESTS

LOCAL = MANIFESTS / "local-cpu.yaml"
# Small enough to run in a second: the shipped local-cpu model with short sequences.
SHORT = ["model.seq_len=24"]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def run_pipeline(stages, tokens):
    """Chain the stages like a trainer does: detach at every boundary, return the tail logits and
    the (wire_in, wire_out) pair of every stage so the backward can be walked tail → head."""
    wire, hops = None, []
    for stage in stages:
        wire_in = None if wire is None else wire.detach().requires_grad_(True)
        wire = stage(wire_in, tokens)
        hops.append((wire_in, wire))
    return wire, hops


def backward_pipeline(loss, hops):
    loss.backward()
    for i in range(len(hops) - 2, -1, -1):
        hops[i][1].backward(hops[i + 1][0].grad)


def perturb_(module, seed=1, scale=0.05):
    """Move every parameter off its initial value (trained-looking weights), identically by name."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            g = torch.Generator().manual_seed(seed + sum(map(ord, name)))
            p.add_(torch.randn(p.shape, generator=g) * scale)


VARIANTS = {
    "ssn-gqa": SHORT,
    "dense": SHORT + ["model.ssn.rank=null"],
    "ssn-mha-4-stages": SHORT + ["model.n_kv_heads=null", "model.n_layers=5",
                                 "stages=[{role: head, layers: 1}, {role: body, layers: 2}, "
                                 "{role: body, layers: 1}, {role: tail, layers: 1}]"],
    "surrogate": SHORT + ["model.family=surrogate", "model.ssn.rank=null", "model.surrogate.dummy_params=10"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chained_stages_reproduce_monolithic_loss_and_every_gradient(variant):
    run = load_manifest(LOCAL, VARIANTS[variant])
    model = build_model(run)
    stages = [build_stage(run, i) for i in range(len(run.stages))]

    # Same names, same initial values: the monolithic state_dict is exactly the union of the stages'.
    mono = model.state_dict()
    union = {k: v for s in stages for k, v in s.state_dict().items()}
    assert sorted(union) == sorted(mono)
    assert sum(len(s.state_dict()) for s in stages) == len(mono)  # no name in two stages
    for k, v in union.items():
        assert torch.equal(v, mono[k]), k

    # Train-like weights, identical on both sides.
    perturb_(model)
    for s in stages:
        perturb_(s)

    inputs, labels = split_sample(torch.randint(0, run.model.vocab_size, (3, run.model.seq_len + 1),
                                                generator=torch.Generator().manual_seed(0)))
    ref = lm_loss(model(inputs), labels)
    ref.backward()
    logits, hops = run_pipeline(stages, inputs)
    loss = lm_loss(logits, labels)
    backward_pipeline(loss, hops)

    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
    grads = dict(model.named_parameters())
    n = 0
    for s in stages:
        for name, p in s.named_parameters():
            ref_grad = grads[name].grad
            if ref_grad is None:  # surrogate dummy parameters never take part in compute
                assert p.grad is None and name.startswith("dummy."), name
                continue
            n += 1
            assert torch.allclose(p.grad, ref_grad, rtol=1e-4, atol=1e-6 * ref_grad.abs().max().item()), name
    assert n == sum(1 for _, p in model.named_parameters() if p.grad is not None)


def test_stage_roles_shapes_and_global_block_names():
    run = load_manifest(MANIFESTS / "pluralis-8b.yaml", [])
    body1 = build_stage(run, 1, "meta")
    assert isinstance(body1, StageModule) and (body1.index, body1.role, body1.name) == (1, "body", "body-1")
    start, stop = run.layer_range(1)
    names = stage_parameter_names(run, 1)
    assert f"blocks.{start}.attn.wq.weight" in names and f"blocks.{stop - 1}.mlp.w2.weight" in names
    assert not any(n.startswith(f"blocks.{start - 1}.") for n in names)
    assert "embed.weight" in stage_parameter_names(run, 0)
    assert {"norm.weight", "lm_head.weight"} <= set(stage_parameter_names(run, len(run.stages) - 1))

    local = load_manifest(LOCAL, SHORT)
    stages = [build_stage(local, i) for i in range(3)]
    tokens = torch.randint(0, 257, (2, 24))
    head_out = stages[0](None, tokens)
    assert head_out.shape == (2, 24, 16) and head_out.dtype == torch.float32
    assert stages[1](head_out, tokens).shape == (2, 24, 16)
    assert stages[2](head_out, tokens).shape == (2, 24, 257)
    with pytest.raises(ValueError, match="needs the previous stage"):
        stages[1](None, tokens)
    # Fixed buffers never reach a state_dict (checkpoints and SPARTA hold trainable values only).
    assert all(not k.startswith(("codec.", "rotary.")) for k in stages[0].state_dict())


def test_every_replica_of_a_stage_starts_identical_and_seed_changes_it():
    run = load_manifest(LOCAL, SHORT)
    a, b = build_stage(run, 1).state_dict(), build_stage(run, 1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = build_stage(load_manifest(LOCAL, SHORT + ["training.seed=7"]), 1).state_dict()
    assert not torch.equal(a["blocks.2.attn.wq.weight"], c["blocks.2.attn.wq.weight"])


@pytest.mark.parametrize("manifest", sorted(p.name for p in MANIFESTS.glob("*.yaml")))
def test_counts_from_modules_equal_manifest_plan(manifest):
    run = load_manifest(MANIFESTS / manifest, [])
    for i in range(len(run.stages)):
        assert model_stage_counts(run, i) == stage_counts(run, i), run.stage_names()[i]


def test_ablation_1b_matches_report_section_6_1():
    run = load_manifest(MANIFESTS / "ablation-1b.yaml", [])
    counts = [model_stage_counts(run, i) for i in range(len(run.stages))]
    trainable, dense = sum(c.trainable for c in counts), sum(c.dense for c in counts)
    assert abs(trainable / 0.94e9 - 1) < 0.05, trainable
    assert abs(dense / 1.40e9 - 1) < 0.05, dense
    lighter = [1 - c.trainable / c.dense for c in counts]
    assert abs(lighter[0] - 0.50) < 0.05  # head: ~50% lighter (embedding factorized too)
    assert all(abs(x - 0.35) < 0.05 for x in lighter[1:-1])  # bodies: ~35% lighter


def test_surrogate_counts_include_dummy_params_and_plan_agrees():
    run = load_manifest(LOCAL, ["model.family=surrogate", "model.ssn.rank=null", "model.surrogate.dummy_params=1000"])
    for i in range(3):
        c = model_stage_counts(run, i)
        assert c == stage_counts(run, i) and c.buffers == 0
    assert "dummy.1" in stage_parameter_names(run, 1)


def test_residual_stream_stays_in_the_subspace_whatever_the_weights():
    """By construction: X - T_fixed[tokens] lies in span(U_k) whatever the weights."""
    run = load_manifest(LOCAL, SHORT)
    head: LlamaStage = build_stage(run, 0)
    opt = torch.optim.Adam(head.parameters(), lr=0.05)
    tokens = torch.randint(0, 257, (2, 24))
    for _ in range(3):  # big steps: the weights move far from their initial values
        opt.zero_grad()
        head(None, tokens).pow(2).mean().backward()
        opt.step()
    perturb_(head, scale=0.5)
    x = head.hidden(None, tokens).detach()
    u, fixed = head.codec.basis, head.codec.fixed_embedding
    r = x - fixed[tokens]
    outside = r - (r @ u) @ u.t()
    assert outside.abs().max() <= 1e-5 * r.abs().max()


def test_bf16_autocast_keeps_the_boundary_exact_and_the_wire_fp32(monkeypatch):
    """Under bf16 autocast the blocks compute in bf16, but the U_k expansions, the residual stream and the
    codec stay fp32, so the residual still lies in the subspace and the wire is fp32. (CUDA is where
    autocast is on in a run; the CPU is forced here to check the same code path.)"""
    import agoractl.model.llama as model_module

    monkeypatch.setattr(model_module, "AUTOCAST_DEVICES", ("cuda", "cpu"))
    run = load_manifest(LOCAL, SHORT + ["training.precision=bf16"])
    head, body, tail = (build_stage(run, i) for i in range(3))
    for s in (head, body, tail):
        perturb_(s, scale=0.2)
    tokens = torch.randint(0, 257, (2, 24))
    wire = head(None, tokens)
    assert wire.dtype == torch.float32
    x = body.hidden(wire, tokens)
    assert x.dtype == torch.float32
    r = x.detach() - body.codec.fixed_embedding[tokens]
    u = body.codec.basis
    assert (r - (r @ u) @ u.t()).abs().max() <= 1e-5 * r.abs().max()
    logits = tail(wire, tokens)
    assert logits.dtype == torch.bfloat16 and logits.shape == (2, 24, 257)
    assert torch.isfinite(lm_loss(logits, tokens))  # the loss itself is computed in fp32
    # The blocks really ran in bf16: the result differs from the fp32 computation, but only slightly.
    monkeypatch.setattr(model_module, "AUTOCAST_DEVICES", ("cuda",))
    x32 = body.hidden(wire, tokens)
    assert not torch.equal(x, x32) and torch.allclose(x, x32, rtol=0.05, atol=0.05 * x32.abs().max().item())


@pytest.mark.parametrize("rank", ["null", "16"])
def test_a_whole_stage_is_the_monolithic_model(rank):
    # Role whole: token ids in, logits out, the same parameters (names and values) as the centralized model.
    run = load_manifest(LOCAL, SHORT + [f"model.ssn.rank={rank}", "stages=[{role: whole, layers: 4}]"])
    stage, model = build_stage(run, 0), build_model(run)
    assert (stage.role, stage.name, stage.embeds, stage.computes_loss) == ("whole", "whole", True, True)
    a, b = stage.state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tokens = torch.randint(0, 257, (2, 24))
    torch.testing.assert_close(stage(None, tokens), model(tokens), rtol=0, atol=0)
