"""benchmarks/boundary_bytes.py runs and measures what the plan predicts: SSN boundaries of local-cpu carry
k/d = 1/4 of the dense bytes, the codec round trip is exact. A real subprocess; CPU; no network."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_boundary_bytes_json_measures_the_rank_ratio():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/boundary_bytes.py"), "--json",
                           "--manifests", "local-cpu", "--tokens", "64"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (r,) = json.loads(proc.stdout)["results"]
    assert (r["d_model"], r["rank"], r["tokens"]) == (64, 16, 64)
    assert r["roundtrip_rel_error"] < 1e-5
    for name, v in r["dtypes"].items():
        assert abs(v["activation_ratio"] - 4.0) < 0.05, name
        # Measured on the wire = the plan's analytic bytes + token ids + a few bytes of framing.
        overhead = v["ssn_bytes_per_token"] - v["plan_ssn_bytes_per_token"] - r["token_id_bytes_per_token"]
        assert 0 <= overhead < 1.0, (name, overhead)
    assert r["dtypes"]["bf16"]["ssn_bytes_per_token"] < 0.6 * r["dtypes"]["fp32"]["ssn_bytes_per_token"]
