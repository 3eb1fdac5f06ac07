"""Monitoring's cost in throughput: the same ``launch swarm`` with ``monitoring.enabled`` off and on, alternating
in the same run (Done-when of the monitoring issue: on costs <= 3% of the tokens/s of off).

With monitoring on, `launch swarm` also starts the Health Monitor (a DHT client reading every record each
``monitoring.interval_s``, writing SQLite), a push gateway and a Prometheus server scraping every node's
/metrics each ``monitoring.scrape_interval_s``; the nodes serve /metrics. Both sides train
``manifests/local-cpu.yaml`` (plus any ``--set``) on the same sample corpus, generated and sharded into a
temporary directory first; every artefact (checkpoints, run directories, databases) stays in it. Each side runs
``--repeats`` times, alternating (off, on, off, ...); ``ratio`` is the median of the paired ratios on/off, and
``cost`` = 1 - ratio. The JSON also holds the machine's load average before and after (``os.getloadavg``).

    python benchmarks/monitoring_cost.py                          # a table
    python benchmarks/monitoring_cost.py --json --out cost.json   # JSON on stdout and in a file
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="Training steps per run.")
    ap.add_argument("--repeats", type=int, default=2, help="Runs of each side, alternating.")
    ap.add_argument("--interval", type=float, default=5.0,
                    help="monitoring.interval_s and monitoring.scrape_interval_s of the on side, in seconds.")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="Extra manifest overrides.")
    ap.add_argument("--json", action="store_true", help="JSON on stdout.")
    ap.add_argument("--out", type=Path, help="Also write the JSON here.")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="agora-monitoring-bench-") as tmp:
        tmp = Path(tmp)
        data = sample_shards(tmp, MANIFEST)
        base = data + [f"training.max_steps={args.steps}", "data_parallel.method=none", "model.seq_len=64",
                       "training.global_batch_size=8", "workers.max_microbatch=8", "trainers.microbatch=1",
                       "workers.announce_period_s=1",
                       "trainers.discovery_period_s=2", "network.startup_timeout_s=90", *args.overrides]
        on = ["monitoring.enabled=true", f"monitoring.interval_s={args.interval:g}",
              f"monitoring.scrape_interval_s={args.interval:g}"]
        runs: dict[str, list[float]] = {"off": [], "on": []}
        load_before = os.getloadavg()
        for i in range(args.repeats):
            for side in ("off", "on"):
                where = tmp / f"{side}-{i}"
                unread(tmp / "shards")  # every run trains the same samples, from the data's beginning
                report = agoractl("launch", "swarm", str(MANIFEST),
                                  *sets(base + (on if side == "on" else []) +
                                        [f"local.run_dir={where}", f"checkpoints.store={where / 'store'}"]))
                runs[side].append(report["tokens_per_s"])
                print(f"{side} #{i}: {report['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    ratios = [b / a for a, b in zip(runs["off"], runs["on"])]
    ratio = statistics.median(ratios)
    out = {"benchmark": "monitoring_cost", "steps": args.steps, "repeats": args.repeats, "interval_s": args.interval,
           "off_tokens_per_s": statistics.median(runs["off"]), "on_tokens_per_s": statistics.median(runs["on"]),
           "ratio": ratio, "cost": 1 - ratio, "ratios": ratios, "runs": runs, "target_cost": 0.03,
           "load_before": load_before, "load_after": os.getloadavg()}
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"monitoring off {out['off_tokens_per_s']:.0f} tokens/s, on {out['on_tokens_per_s']:.0f} tokens/s: "
              f"cost {out['cost']:.1%} (paired ratios {', '.join(f'{r:.3f}' for r in ratios)}; target <= 3%)")


if __name__ == "__main__":
    main()
