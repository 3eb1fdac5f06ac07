"""Wire bytes per token across a stage boundary: dense vs reparameterized SSN (report §4.1).

For each manifest (default: local-cpu and ablation-1b) it builds the head stage twice — with the
manifest's SSN rank and with dense boundaries (``model.ssn.rank: null``) — runs a forward pass,
and serializes what a worker would send downstream (the wire tensor in fp32, bf16 and fp16, plus
the token ids as int32) with hivemind's tensor serializer, the runtime's transport. Bytes per token
are measured, not computed; the manifest plan's analytic figure is printed beside them as a check.
It also reports the codec's round-trip error decode(encode(X)) − X at that boundary.

Only what the boundary depends on is kept from the manifest (d_model, rank, heads); the model is
shrunk to one block, a 300-token vocabulary and a narrow MLP so the 1B manifest runs in seconds
on a laptop CPU. Bytes per token do not depend on those.

    python benchmarks/boundary_bytes.py            # a table
    python benchmarks/boundary_bytes.py --json     # JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# hivemind sends bf16 as fp32 unless told otherwise (its legacy default); workers should set this.
os.environ.setdefault("USE_LEGACY_BFLOAT16", "0")

import torch  # noqa: E402
from hivemind.compression import serialize_torch_tensor  # noqa: E402
from hivemind.proto.runtime_pb2 import CompressionType  # noqa: E402

from agoractl.manifest.loader import load_manifest  # noqa: E402
from agoractl.manifest.plan import boundary_bytes_per_token  # noqa: E402
from agoractl.model.codec import WIRE_DTYPES, to_wire  # noqa: E402
from agoractl.model.build import build_stage, dense_equivalent  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ["local-cpu", "ablation-1b"]
SHRINK = ["model.d_ff=64", "model.vocab_size=300", "tokenizer.kind=bytes", "tokenizer.path=null",
          "stages=[{role: head, layers: 1}, {role: tail, layers: 1}]", "model.n_layers=2"]


def wire_bytes(t: torch.Tensor) -> int:
    """Bytes of `t` as hivemind's transport serializes it (no compression)."""
    return serialize_torch_tensor(t, CompressionType.NONE).ByteSize()


def measure(manifest: str, tokens: int) -> dict:
    path = ROOT / "manifests" / f"{manifest}.yaml"
    run = load_manifest(path, SHRINK)
    full = load_manifest(path, [])
    t = min(tokens, run.model.seq_len)
    ids = torch.randint(0, run.model.vocab_size, (1, t), generator=torch.Generator().manual_seed(0))
    token_bytes = wire_bytes(ids.to(torch.int32)) / t
    out = {"manifest": manifest, "d_model": run.model.d_model, "rank": run.model.ssn.rank, "tokens": t,
           "token_id_bytes_per_token": token_bytes, "dtypes": {}}
    wires = {}
    with torch.no_grad():
        for variant, r in (("ssn", run), ("dense", dense_equivalent(run))):
            head = build_stage(r, 0)
            t0 = time.perf_counter()
            x = head.hidden(None, ids)
            wire = head.codec.encode(x, ids)
            encode_s = time.perf_counter() - t0
            wires[variant] = wire
            if variant == "ssn":
                # The receiver's own codec (a separately built stage) rebuilds X.
                receiver = build_stage(r, 1).codec
                err = (receiver.decode(wire, ids) - x).abs().max().item()
                out["roundtrip_max_abs_error"] = err
                out["roundtrip_rel_error"] = err / x.abs().max().item()
                out["head_forward_s"] = encode_s
    for name in WIRE_DTYPES:
        per = {v: wire_bytes(to_wire(w, name)) / t for v, w in wires.items()}
        plan = boundary_bytes_per_token(full, torch.finfo(WIRE_DTYPES[name]).bits // 8)
        out["dtypes"][name] = {
            "dense_bytes_per_token": per["dense"] + token_bytes,
            "ssn_bytes_per_token": per["ssn"] + token_bytes,
            "activation_ratio": per["dense"] / per["ssn"],
            "ratio_with_token_ids": (per["dense"] + token_bytes) / (per["ssn"] + token_bytes),
            "plan_dense_bytes_per_token": plan["dense"],
            "plan_ssn_bytes_per_token": plan["compressed"],
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="JSON on stdout instead of a table")
    p.add_argument("--manifests", nargs="+", default=DEFAULT, help="manifest names under manifests/")
    p.add_argument("--tokens", type=int, default=256, help="tokens per measured request (capped at seq_len)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = {"benchmark": "boundary_bytes", "transport": "hivemind serialize_torch_tensor, no compression",
               "use_legacy_bfloat16": os.environ["USE_LEGACY_BFLOAT16"],
               "results": [measure(m, args.tokens) for m in args.manifests]}
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'manifest':<13} {'d':>5} {'k':>4} {'wire':<5} {'dense B/tok':>12} {'SSN B/tok':>10} "
          f"{'act. ratio':>10} {'with ids':>9} {'plan d/k B':>12}")
    for r in results["results"]:
        for name, v in r["dtypes"].items():
            print(f"{r['manifest']:<13} {r['d_model']:>5} {r['rank'] or '-':>4} {name:<5} "
                  f"{v['dense_bytes_per_token']:>12.1f} {v['ssn_bytes_per_token']:>10.1f} "
                  f"{v['activation_ratio']:>9.1f}x {v['ratio_with_token_ids']:>8.1f}x "
                  f"{v['plan_dense_bytes_per_token']:>5}/{v['plan_ssn_bytes_per_token']:<6}")
        print(f"{'':<13} token ids {r['token_id_bytes_per_token']:.1f} B/token (int32); codec round trip "
              f"max |error| {r['roundtrip_max_abs_error']:.2e} (relative {r['roundtrip_rel_error']:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
