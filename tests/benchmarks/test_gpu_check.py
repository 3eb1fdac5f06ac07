"""benchmarks/gpu_check.py on a machine without CUDA: one line saying so, exit code 2, nothing started; and its
FLOP count of a token against the dimensions of the shape it trains."""

from __future__ import annotations

import subprocess
import sys

from tests.benchmarks import load_benchmark
from tests.conftest import ROOT


def test_without_cuda_it_says_so_in_one_line_and_exits_2():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu_check.py")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "CUDA is not available" in lines[0] and "--device cpu" in lines[0]
    assert not proc.stdout


def test_the_flops_of_a_token_are_six_per_weight_that_multiplies_plus_attention():
    bench = load_benchmark("gpu_check")
    d, layers, d_ff, kv, k, vocab, seq = 1024, 12, 2816, 512, 128, 257, 512
    # The SSN (report §3.4) writes to the residual stream in its rank-k subspace: o and w2 map to k, not d.
    per_layer = d * d + 2 * d * kv + d * k + 2 * d * d_ff + d_ff * k + 2 * d  # q; k, v; o; w1, w3; w2; norms
    dense = layers * per_layer + d + d * vocab  # the final norm and the LM head; the embedding table excluded
    assert bench.flops_per_token(bench.GPU_SHAPE) == 6 * dense + 12 * layers * d * seq
