"""Tests of the surrogate family (agoractl.model.surrogate, report §3.5.1.1): wire shape, injected
forward/backward delays, dummy parameters that inflate the payload but get no gradient. In-process, CPU."""

from __future__ import annotations

import time

import torch

from agoractl.manifest.loader import load_manifest
from agoractl.model.build import build_stage
from agoractl.model.llama import lm_loss, split_sample
from agoractl.model.surrogate import SurrogateStage
from tests.conftest import MANIFESTS

SURROGATE = ["model.family=surrogate", "model.ssn.rank=null", "model.seq_len=32",
             "model.surrogate.forward_delay_ms=80", "model.surrogate.backward_delay_ms=120",
             "model.surrogate.dummy_params=5000"]


def test_surrogate_stage_wire_shape_delays_and_dummy_params():
    torch.set_num_threads(1)
    run = load_manifest(MANIFESTS / "local-cpu.yaml", SURROGATE)
    head, body, tail = (build_stage(run, i) for i in range(3))
    assert isinstance(body, SurrogateStage) and body.wire_width == run.model.d_model
    inputs, labels = split_sample(torch.randint(0, 257, (2, 33)))

    t0 = time.monotonic()
    wire = head(None, inputs)
    forward_s = time.monotonic() - t0
    assert wire.shape == (2, 32, 64)  # [B, seq_len, d_model], like a dense boundary
    assert forward_s >= 0.08

    wire_in = wire.detach().requires_grad_(True)
    out = body(wire_in, inputs)
    t0 = time.monotonic()
    out.backward(torch.ones_like(out))
    assert time.monotonic() - t0 >= 0.12
    assert wire_in.grad.shape == (2, 32, 64)

    loss = lm_loss(tail(out.detach(), inputs), labels)
    assert torch.isfinite(loss)
    assert body.dummy["1"].numel() == 5000 and body.dummy["1"].grad is None
