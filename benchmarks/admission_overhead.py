"""Admission's cost in throughput: the same ``launch swarm`` with ``admission.enabled`` off and on, alternating
in the same run (Done-when of the Authorizer issue: on keeps >= 0.95 x the tokens/s of off).

With admission on, `launch swarm` starts an Authorizer on loopback and every node joins through it; every
stage request then carries a credential the worker verifies (Ed25519), every DHT record carries one its
readers verify, and (``--method sparta``, the default: 2 stages x 2 workers averaging every 5 steps) every
averaging RPC between replicas goes through the credential handshake and gate (runtime/averaging_auth.py);
``--method none`` measures the pipeline alone (1 worker per stage of the manifest's 3 stages). Both sides
train ``manifests/local-cpu.yaml`` (plus any ``--set``) on the same sample corpus, generated and sharded into a
temporary directory first. Each side runs ``--repeats`` times, alternating (off,
on, off, ...); ``ratio`` is the median of the paired ratios on/off (each on run against the off run just before
it: these machines are shared and their speed drifts), beside the medians of each side.

    python benchmarks/admission_overhead.py            # a table
    python benchmarks/admission_overhead.py --json     # JSON on stdout

The JSON also holds each run's SPARTA rounds and averaging success per stage (the gate was exercised) and the
machine's load average before and after (``os.getloadavg``): figures taken on a loaded machine mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from cli_runs import ROOT, agoractl, sample_shards, sets, unread

MANIFEST = ROOT / "manifests" / "local-cpu.yaml"
ADMISSION = ["admission.enabled=true", "admission.min_vram_gb=0", "admission.min_ram_gb=0",
             "admission.min_bandwidth_mbps=0", "admission.max_latency_ms=10000", "admission.joins_per_minute=6000",
             "admission.credential_ttl_s=60"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="Training steps per run.")
    ap.add_argument("--repeats", type=int, default=2, help="Runs of each side, alternating.")
    ap.add_argument("--method", choices=["sparta", "none"], default="sparta",
                    help="data_parallel.method: sparta (2 stages x 2 workers, the averaging gate too) or none.")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="Extra manifest overrides.")
    ap.add_argument("--json", action="store_true", help="JSON on stdout.")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="agora-admission-bench-") as tmp:
        tmp = Path(tmp)
        data = sample_shards(tmp, MANIFEST)
        method = (["stages=[{role: head, layers: 2}, {role: tail, layers: 2}]", "local.workers_per_stage=2",
                   "data_parallel.method=sparta", "data_parallel.sparta.every_steps=5",
                   "data_parallel.sparta.matchmaking_timeout_s=10"] if args.method == "sparta"
                  else ["data_parallel.method=none"])
        load_before = os.getloadavg()
        base = data + [f"training.max_steps={args.steps}", *method, "model.seq_len=64",
                       "training.global_batch_size=8", "workers.max_microbatch=8", "trainers.microbatch=1",
                       "workers.announce_period_s=1",
                       "trainers.discovery_period_s=2", "network.startup_timeout_s=90", *args.overrides]
        runs: dict[str, list[float]] = {"off": [], "on": []}
        averaging: dict[str, list[dict]] = {"off": [], "on": []}
        for i in range(args.repeats):
            for side in ("off", "on"):
                extra = ADMISSION if side == "on" else []
                own = tmp / f"{side}-{i}"  # every artefact stays in the temporary directory; a fresh store each
                unread(tmp / "shards")  # every run trains the same samples, from the data's beginning
                report = agoractl("launch", "swarm", str(MANIFEST),
                                  *sets(base + extra + [f"local.run_dir={own}", f"checkpoints.store={own / 'store'}"]))
                runs[side].append(report["tokens_per_s"])
                keys = ("averaging_rounds", "averaging_success_mean", "rounds_failed")
                averaging[side].append({st["name"]: {k: st.get(k) for k in keys} for st in report["stages"]})
                print(f"{side} #{i}: {report['tokens_per_s']:.0f} tokens/s {averaging[side][-1]}", file=sys.stderr)
    ratios = [on / off for on, off in zip(runs["on"], runs["off"])]
    out = {"benchmark": "admission_overhead", "steps": args.steps, "repeats": args.repeats, "method": args.method,
           "off_tokens_per_s": statistics.median(runs["off"]), "on_tokens_per_s": statistics.median(runs["on"]),
           "ratio": statistics.median(ratios), "ratios": ratios, "runs": runs, "target": 0.95,
           "averaging": averaging, "load_before": load_before, "load_after": os.getloadavg()}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"admission off {out['off_tokens_per_s']:.0f} tokens/s, on {out['on_tokens_per_s']:.0f} tokens/s: "
              f"ratio {out['ratio']:.3f} (paired {', '.join(f'{r:.3f}' for r in ratios)}; target >= 0.95; "
              f"load {load_before[0]:.1f} before, {out['load_after'][0]:.1f} after)")


if __name__ == "__main__":
    main()
