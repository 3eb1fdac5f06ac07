"""Tests of the SSN boundary codec (agoractl.model.codec): exact reconstruction at every boundary,
across processes (U_k and T_fixed rebuilt from the seed in each, never shipped), k-wide gradients,
and the fp32/bf16/fp16 wire. CPU; one real subprocess; no network."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from agoractl.manifest.loader import load_manifest
from agoractl.model.codec import BoundaryCodec, from_wire, to_wire
from agoractl.model.build import build_stage
from agoractl.model.subspace import orthonormal_basis
from tests.conftest import MANIFESTS, ROOT

MANIFEST = MANIFESTS / "ablation-1b.yaml"
# The ablation model's real width and rank (d=2048, k=40) with everything else shrunk, so its
# stages are built in a blink; the codec only depends on d, k, V and the seeds.
SMALL_1B = ["model.n_layers=4", "model.d_ff=64", "model.vocab_size=300", "model.seq_len=16",
            "tokenizer.kind=bytes", "tokenizer.path=null",
            "stages=[{role: head, layers: 1}, {role: body, layers: 1}, {role: body, layers: 1}, {role: tail, layers: 1}]"]

# Runs in a fresh interpreter: build every stage from the manifest, move the weights off their
# initial values, run the pipeline, and save each boundary's d-wide X, its coordinates and tokens.
SENDER = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import save_file
    torch.set_num_threads(1)
    from agoractl.manifest.loader import load_manifest
    from agoractl.model.build import build_stage
    run = load_manifest(sys.argv[1], sys.argv[3:])
    tokens = torch.randint(0, run.model.vocab_size, (2, run.model.seq_len), generator=torch.Generator().manual_seed(3))
    out, wire = {"tokens": tokens}, None
    for i in range(len(run.stages) - 1):
        stage = build_stage(run, i)
        with torch.no_grad():
            for p in stage.parameters():
                p.add_(torch.randn_like(p) * 0.1)
            x = stage.hidden(wire, tokens)
            wire = stage.codec.encode(x, tokens)
        out[f"x{i}"], out[f"coords{i}"] = x.contiguous(), wire.contiguous()
    save_file(out, sys.argv[2])
""")


def test_decode_encode_is_exact_at_every_boundary_across_processes(tmp_path):
    torch.set_num_threads(1)
    path = tmp_path / "boundaries.safetensors"
    proc = subprocess.run([sys.executable, "-c", SENDER, str(MANIFEST), str(path), *SMALL_1B], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    sent = load_file(path)
    run = load_manifest(MANIFEST, SMALL_1B)
    tokens = sent["tokens"]
    for i in range(len(run.stages) - 1):
        receiver = build_stage(run, i + 1).codec  # this process's own U_k and T_fixed
        x, coords = sent[f"x{i}"], sent[f"coords{i}"]
        assert coords.shape == (2, run.model.seq_len, 40)  # k values per token, not d = 2048
        rebuilt = receiver.decode(coords, tokens)
        scale = x.abs().max()
        assert (rebuilt - x).abs().max() <= 1e-5 * scale, f"boundary {i}"
        assert (receiver.encode(x, tokens) - coords).abs().max() <= 1e-5 * scale, f"boundary {i}"


def test_basis_is_orthonormal_and_a_function_of_the_seed():
    u = orthonormal_basis(256, 16, seed=0)
    assert torch.allclose(u.t() @ u, torch.eye(16), atol=1e-6)
    assert torch.equal(u, orthonormal_basis(256, 16, seed=0))
    assert not torch.allclose(u, orthonormal_basis(256, 16, seed=1))


def test_gradients_cross_the_boundary_k_wide():
    run = load_manifest(MANIFESTS / "local-cpu.yaml", ["model.seq_len=16"])
    body = build_stage(run, 1)
    tokens = torch.randint(0, 257, (2, 16))
    wire_in = build_stage(run, 0)(None, tokens).detach().requires_grad_(True)
    out = body(wire_in, tokens)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    assert wire_in.grad.shape == (2, 16, 16)  # the gradient sent upstream is k-wide too
    # It is the d-wide gradient of the residual stream, compressed by the same U_k.
    x = body.codec.decode(wire_in.detach(), tokens).requires_grad_(True)
    body.codec.encode(body._blocks(x), tokens).backward(grad_out)
    assert torch.allclose(wire_in.grad, x.grad @ body.codec.basis, atol=1e-6)


def test_dense_codec_is_the_identity():
    run = load_manifest(MANIFESTS / "local-cpu.yaml", ["model.ssn.rank=null"])
    codec = BoundaryCodec(run.model)
    x = torch.randn(2, 3, 64)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    assert codec.width == 64 and torch.equal(codec.decode(codec.encode(x, tokens), tokens), x)
    assert list(codec.buffers()) == []


@pytest.mark.parametrize("dtype,torch_dtype,rel", [("fp32", torch.float32, 0.0), ("bf16", torch.bfloat16, 2**-8),
                                                    ("fp16", torch.float16, 2**-11)])
def test_wire_dtypes(dtype, torch_dtype, rel):
    t = torch.randn(4, 8, 40, requires_grad=True)
    sent = to_wire(t, dtype)
    assert sent.dtype == torch_dtype and not sent.requires_grad and sent.is_contiguous()
    back = from_wire(sent)
    assert back.dtype == torch.float32
    # Relative rounding in the normal range; below it (fp16 subnormals, |x| < 6.1e-5) the spacing is fixed.
    subnormal_step = torch.finfo(torch_dtype).tiny * torch.finfo(torch_dtype).eps
    assert ((back - t.detach()).abs() <= rel * t.detach().abs() + subnormal_step).all()


def test_unknown_wire_dtype_names_the_choices():
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        to_wire(torch.zeros(1), "int8")
