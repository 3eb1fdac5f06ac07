"""Divergence analysis throughput: MB of replica snapshots analysed per second, against just reading
the same files (the baseline, measured in the same run).

It writes synthetic replica snapshots of one stage (the local-cpu manifest widened to
``--d-model``; ``--replicas`` replicas at each of ``--steps`` snapshot steps) into a store (default
a temporary local directory; ``--store s3://...`` with the usual environment), then times

- read: every snapshot file read whole through fsspec, nothing computed;
- analyze: ``analyze_divergence(..., js=False)``: per-segment variance, consensus movement and
  pairwise L2, reading the files side by side in chunks (the JS pass runs the model and is not an
  I/O rate, so it is left out).

Each is run ``--repeats`` times, alternating, after one warm-up read (so both see a warm page
cache); the best run of each is reported. The ratio analyze/read says how close the analysis comes
to the speed of simply reading its input.

    python benchmarks/analyze_throughput.py            # a table
    python benchmarks/analyze_throughput.py --json     # JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from agoractl.manifest.loader import load_manifest
from agoractl.ops.analyze import analyze_divergence
from agoractl.ops.checkpoint import CheckpointStore
from agoractl.model.build import build_stage

ROOT = Path(__file__).resolve().parent.parent


def make_snapshots(run, store: CheckpointStore, stage: str, replicas: int, steps: int) -> int:
    """Replica snapshots of `stage` drifting apart step by step; returns the bytes written."""
    index, _ = run.stage(stage)
    base = build_stage(run, index).state_dict()
    g = torch.Generator().manual_seed(0)
    for k in range(1, steps + 1):
        for r in range(replicas):
            state = {n: v + 1e-3 * k * torch.randn(v.shape, generator=g) for n, v in base.items()}
            store.save_snapshot(stage, 100 * k, f"worker-{r}", state)
    return sum(store.fs.size(store.fs._strip_protocol(store.snapshot_url(stage, 100 * k, f"worker-{r}")))
               for k in range(1, steps + 1) for r in range(replicas))


def read_all(store: CheckpointStore, stage: str) -> int:
    """Read every snapshot file of `stage` whole, in 8 MB pieces; returns the bytes read."""
    total = 0
    for step in store.snapshot_steps(stage):
        for r in store.snapshot_replicas(stage, step):
            with store.fs.open(store.fs._strip_protocol(store.snapshot_url(stage, step, r)), "rb") as f:
                while chunk := f.read(8 << 20):
                    total += len(chunk)
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=256, help="Hidden width of the synthetic stage.")
    ap.add_argument("--stage", default="head", help="Stage of the local-cpu manifest to snapshot.")
    ap.add_argument("--replicas", type=int, default=4, help="Replicas per snapshot step.")
    ap.add_argument("--steps", type=int, default=3, help="Snapshot steps.")
    ap.add_argument("--repeats", type=int, default=3, help="Timed runs of each, best kept.")
    ap.add_argument("--threads", type=int, default=1, help="torch threads.")
    ap.add_argument("--store", default=None, help="Store URL (default: a temporary local directory).")
    ap.add_argument("--json", action="store_true", help="Print one JSON object on stdout.")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        url = args.store or f"{tmp}/store"
        run = load_manifest(ROOT / "manifests" / "local-cpu.yaml",
                            [f"checkpoints.store={url}", f"model.d_model={args.d_model}", f"model.n_heads={args.d_model // 64 * 2}",
                             f"model.d_ff={args.d_model * 8 // 3 // 8 * 8}"])
        store = CheckpointStore(run)
        written = make_snapshots(run, store, args.stage, args.replicas, args.steps)
        read_all(store, args.stage)  # warm-up: both measurements start from the same cache state
        read_s, analyze_s, bytes_read = [], [], 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            n = read_all(store, args.stage)
            read_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = analyze_divergence(run, args.stage, js=False, store=store)
            analyze_s.append(time.perf_counter() - t0)
            bytes_read = out["bytes_read"]
            assert n == written == bytes_read, (n, written, bytes_read)
    mb = written / 1e6
    result = {
        "store": "local" if args.store is None else args.store, "stage": args.stage, "d_model": args.d_model,
        "parameters": out["parameters"], "replicas": args.replicas, "steps": args.steps, "mb": round(mb, 3),
        "threads": args.threads, "read_s": round(min(read_s), 4), "analyze_s": round(min(analyze_s), 4),
        "read_mb_per_s": round(mb / min(read_s), 2), "analyze_mb_per_s": round(mb / min(analyze_s), 2),
    }
    result["ratio"] = round(result["analyze_mb_per_s"] / result["read_mb_per_s"], 4)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['mb']:.1f} MB of snapshots: stage {args.stage}, {result['parameters']:,} parameters, "
              f"{args.replicas} replicas x {args.steps} steps, {args.threads} thread(s)")
        print(f"{'':10}{'seconds':>10}{'MB/s':>10}")
        print(f"{'read':10}{result['read_s']:>10.3f}{result['read_mb_per_s']:>10.1f}")
        print(f"{'analyze':10}{result['analyze_s']:>10.3f}{result['analyze_mb_per_s']:>10.1f}")
        print(f"ratio analyze/read: {result['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
