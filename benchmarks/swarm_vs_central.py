"""Swarm against centralized throughput: ``launch swarm`` and ``launch central`` on the same tokens, on
this machine, one after the other in the same run (report §5.4: the Pluralis-8B run reached 63% of a
centralized baseline's efficiency, over the internet).

Both train ``manifests/local-cpu.yaml`` (plus any ``--set``) for the same steps of the same global
batch on the same sample corpus, which the script generates and shards into a temporary directory
first. The swarm's trainers send ``--microbatch`` samples per request with ``--in-flight`` requests each
in flight (default 8 x 1, the centralized reference's micro-batch; see their help). Each is
run ``--repeats`` times, alternating (central, swarm, central, ...), because these machines are shared
and noisy: a machine's speed drifts over minutes, so each swarm run is compared with the central run
just before it, and ``ratio`` is the median of those paired ratios (``central_tokens_per_s`` and
``swarm_tokens_per_s`` are the medians of each side). ``tokens_per_s`` is each report's own (§5.4.0.1:
tokens of the completed steps over the training time, start-up excluded on both sides).

The swarm's profile says where its time goes: CPU seconds during training of the workers' Python
(compute, request handling), of their DHT processes and p2pd daemons, and of the trainers, per
sample, beside the centralized reference's CPU per sample and the wall time per sample of both.

    python benchmarks/swarm_vs_central.py                 # a table
    python benchmarks/swarm_vs_central.py --json          # JSON on stdout
    python benchmarks/swarm_vs_central.py --microbatch 1 --in-flight 16  # the report's single-sample requests
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "manifests" / "local-cpu.yaml"


def agoractl(*args: str, timeout: float = 1800) -> dict:
    """Run an agoractl command with --json; returns its JSON output, with its CPU seconds (children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "agoractl", *args, "--json"], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"agoractl {' '.join(args[:2])} failed with exit code {proc.returncode}")
    out = json.loads(proc.stdout)
    out["_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return out


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]


def swarm_profile(report: dict) -> dict:
    """CPU seconds during training, by component, per completed sample (ms), from the nodes' stats."""
    parts: dict[str, float] = {}

    def add(name: str, end: dict, start: dict) -> None:
        for k, v in end.items():
            parts[f"{name}_{k}"] = parts.get(f"{name}_{k}", 0.0) + v - (start or {}).get(k, 0.0)

    compute = 0.0
    for w in report.get("workers", []):
        if w.get("cpu_s"):  # None for a killed worker (its last DHT record stands in)
            add("worker", w["cpu_s"], w.get("cpu_at_first_request_s") or w.get("cpu_at_ready_s"))
            compute += w.get("compute_s", 0.0)
    for t in report.get("trainers", []):
        if t.get("cpu_s"):
            add("trainer", t["cpu_s"], t.get("cpu_at_start_s"))
    samples = max(1, report.get("samples_completed", 0))
    total = sum(parts.values())
    return {
        "samples": samples,
        "elapsed_s": report["elapsed_s"],
        "cpu_s": round(total, 2),
        "cores_busy": round(total / report["elapsed_s"], 2) if report["elapsed_s"] else None,
        "cpu_ms_per_sample": {k: round(v / samples * 1000, 2) for k, v in sorted(parts.items())},
        "worker_compute_wall_s": round(compute, 2),
        "mean_coalesced": {w["stage"]: round(w["coalesced_sum"] / max(1, sum(w["batches"].values())), 2)
                           for w in report.get("workers", []) if not w.get("killed")},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="Manifest override for both runs (repeatable), e.g. training.max_steps=30.")
    ap.add_argument("--microbatch", type=int, default=8,
                    help="Samples per trainer request in the swarm (trainers.microbatch). The report sends 1 and "
                         "lets workers coalesce; on this tiny model per-request overhead (libp2p, two p2pd hops, "
                         "each costing CPU per call and per byte) outweighs compute, so the default is the "
                         "centralized reference's own micro-batch (workers.max_microbatch, 8). Pass 1 for the "
                         "report's request shape.")
    ap.add_argument("--in-flight", type=int, default=1,
                    help="Requests each trainer keeps in flight (trainers.in_flight). With 2 trainers, 8 x 1 keeps "
                         "16 samples (one global batch) in flight, as 4 x 2 does; more in flight trains on staler "
                         "weights.")
    ap.add_argument("--repeats", type=int, default=3,
                    help="Runs of each, alternating; the median of the paired ratios counts.")
    ap.add_argument("--rows", type=int, default=4000, help="Documents in the generated sample corpus.")
    ap.add_argument("--json", action="store_true", help="Print one JSON object on stdout.")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="swarm-vs-central-") as tmp:
        data = [f"data.source={tmp}/sample/*.parquet", f"data.output={tmp}/shards", "data.num_shards=4"]
        agoractl("data", "sample", "--out", f"{tmp}/sample", "--rows", str(args.rows), "--files", "2")
        agoractl("shard", str(MANIFEST), *[a for s in data for a in ("--set", s)])
        overrides = [f"trainers.microbatch={args.microbatch}", f"trainers.in_flight={args.in_flight}"] + args.sets
        # Every artefact stays in the temporary directory (the store too); each run starts over (--fresh
        # --force: the previous run's checkpoints are moved aside, not resumed).
        sets = [a for s in data + [f"local.run_dir={tmp}/run", f"checkpoints.store={tmp}/store"] + overrides
                for a in ("--set", s)] + ["--fresh", "--force"]
        # The central reference's CPU per training step: a full run minus a one-step run (start-up, imports).
        one_step = agoractl("launch", "central", str(MANIFEST), *sets, "--set", "training.max_steps=1",
                            "--set", "training.schedule.warmup_steps=0")
        central, swarm = [], []
        for i in range(args.repeats):
            central.append(agoractl("launch", "central", str(MANIFEST), *sets))
            print(f"central run {i + 1}: {central[-1]['tokens_per_s']:,.0f} tokens/s", file=sys.stderr, flush=True)
            swarm.append(agoractl("launch", "swarm", str(MANIFEST), *sets))
            print(f"swarm run {i + 1}: {swarm[-1]['tokens_per_s']:,.0f} tokens/s", file=sys.stderr, flush=True)
    pairs = [sw["tokens_per_s"] / ce["tokens_per_s"] for ce, sw in zip(central, swarm)]
    c = median_run(central)
    s = median_run(swarm)
    central_samples = (c["steps"] - 1) * c["global_batch_size"]
    central_cpu_ms = min((r["_cpu_s"] - one_step["_cpu_s"]) for r in central) / max(1, central_samples) * 1000
    result = {
        "manifest": str(MANIFEST.relative_to(ROOT)),
        "overrides": overrides,
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)},
        "steps": s["steps"], "tokens": s["tokens"],
        "central_tokens_per_s": round(c["tokens_per_s"], 1),
        "swarm_tokens_per_s": round(s["tokens_per_s"], 1),
        "ratio": round(statistics.median(pairs), 3),
        "central_final_loss": c["final_loss"],
        "swarm_final_loss": s["final_loss"],
        "all_runs": {"central_tokens_per_s": [round(r["tokens_per_s"], 1) for r in central],
                     "swarm_tokens_per_s": [round(r["tokens_per_s"], 1) for r in swarm],
                     "ratios": [round(r, 3) for r in pairs]},
        "profile": {
            "central": {"elapsed_s": c["elapsed_s"], "wall_ms_per_sample":
                        round(c["elapsed_s"] / (c["steps"] * c["global_batch_size"]) * 1000, 2),
                        "cpu_ms_per_sample": round(central_cpu_ms, 2),
                        "threads": "local.threads_per_process"},
            "swarm": {**swarm_profile(s), "wall_ms_per_sample":
                      round(s["elapsed_s"] / max(1, s["samples_completed"]) * 1000, 2)},
        },
        "swarm_stages": s["stages"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['manifest']} {' '.join(overrides)}: {result['steps']} steps, {result['tokens']:,} tokens, "
          f"{result['machine']['cpus']} CPUs (load {result['machine']['load_avg_1m']})")
    print(f"{'':10} {'tokens/s':>10} {'final loss':>11}   runs")
    print(f"{'central':10} {c['tokens_per_s']:>10,.0f} {c['final_loss']:>11.4f}   {result['all_runs']['central_tokens_per_s']}")
    print(f"{'swarm':10} {s['tokens_per_s']:>10,.0f} {s['final_loss']:>11.4f}   {result['all_runs']['swarm_tokens_per_s']}")
    print(f"ratio swarm/central: {result['ratio']:.2f} (median of the paired runs' {result['all_runs']['ratios']})")
    prof = result["profile"]["swarm"]
    print(f"swarm profile: {prof['cpu_s']} CPU s in {prof['elapsed_s']} s ({prof['cores_busy']} cores busy); "
          f"CPU ms per sample: {prof['cpu_ms_per_sample']}; mean coalesced: {prof['mean_coalesced']}")
    print(f"wall ms per sample: central {result['profile']['central']['wall_ms_per_sample']}, "
          f"swarm {prof['wall_ms_per_sample']}; CPU ms per sample: central "
          f"{result['profile']['central']['cpu_ms_per_sample']}, swarm {round(prof['cpu_s'] / prof['samples'] * 1000, 2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
