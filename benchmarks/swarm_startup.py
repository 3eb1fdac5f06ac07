"""A swarm's start-up: from ``agoractl launch swarm`` to the first optimizer step (issue 24: target 8 s for the DP
manifest on a 2-core machine), with the nodes forked from the launcher (the default,
:mod:`agoractl.runtime.node_process`) against every node an ordinary subprocess (``AGORA_FORK_NODES=0``, the
baseline), in alternating runs of one invocation on the same data and cores.

Each run is a whole ``launch swarm`` of the manifest (default ``manifests/fgdiloco-dp-cpu.yaml``) from the data's
beginning; its report's ``startup_s`` is the figure (the launcher's start, to the clock tick, to the first
optimizer step of any worker). Also recorded per run: the CPU seconds each worker's own process spent until it
served (``cpu_at_ready_s.node``: the imports a forked node skips), tokens/s and the final loss. JSON (``--out``):
every run, and per mode the median start-up and the ratio of the medians.

    python benchmarks/swarm_startup.py --repeats 5 --out swarm_startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cli_runs import ROOT, sample_shards, sets, unread, write_json

MANIFEST = ROOT / "manifests" / "fgdiloco-dp-cpu.yaml"
MODES = {"forked": "1", "subprocess": "0"}
TARGET_S = 8.0


def one_run(manifest: Path, data: list[str], where: Path, fork: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "agoractl", "launch", "swarm", str(manifest), "--fresh", "--force",
                           "--json", *sets(data + [f"local.run_dir={where}", f"checkpoints.store={where / 'store'}"])],
                          capture_output=True, text=True, cwd=ROOT, timeout=1800,
                          env={**os.environ, "AGORA_FORK_NODES": fork})
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1:]
        return {"exit_code": proc.returncode, "error": last[0] if last else ""}
    r = json.loads(proc.stdout)
    return {"exit_code": 0, "startup_s": r["startup_s"], "tokens_per_s": round(r["tokens_per_s"]),
            "final_loss": r["final_loss"],
            "worker_cpu_at_ready_s": [w["cpu_at_ready_s"].get("node") for w in r["workers"]]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--repeats", type=int, default=5, help="runs per mode, alternating")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="manifest override (repeatable)")
    p.add_argument("--out", type=Path, help="write the JSON here")
    a = p.parse_args(argv)
    if a.repeats < 1:
        print("error: --repeats must be at least 1", file=sys.stderr)
        return 2
    runs = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="swarm-startup-") as tmp:
        tmp = Path(tmp)
        data = sample_shards(tmp, a.manifest) + a.overrides
        for i in range(a.repeats):
            for mode, fork in MODES.items():
                unread(tmp / "shards")
                fig = {"repeat": i + 1, "mode": mode, **one_run(a.manifest, data, tmp / f"run-{i}-{mode}", fork)}
                runs.append(fig)
                print(f"{i + 1}/{a.repeats} {mode}: " + (f"start-up {fig['startup_s']} s, {fig['tokens_per_s']:,} "
                      f"tokens/s, worker CPU to ready {fig['worker_cpu_at_ready_s']} s" if fig["exit_code"] == 0
                      else f"exit {fig['exit_code']} {fig['error']}"), file=sys.stderr, flush=True)
    medians = {m: statistics.median([r["startup_s"] for r in runs if r["mode"] == m and r["exit_code"] == 0] or
                                    [float("nan")]) for m in MODES}
    summary = {"median_startup_s": medians, "speedup": round(medians["subprocess"] / medians["forked"], 3),
               "target_s": TARGET_S, "within_target": medians["forked"] <= TARGET_S,
               "failed_runs": sum(r["exit_code"] != 0 for r in runs)}
    result = {"manifest": str(a.manifest), "overrides": a.overrides, "repeats": a.repeats,
              "machine": {"cpus": os.cpu_count(), "load_avg_1m_before": round(load_before, 2),
                          "load_avg_1m_after": round(os.getloadavg()[0], 2)},
              "summary": summary, "runs": runs}
    if a.out is not None:
        write_json(a.out, result)
    print(json.dumps(summary))
    return 0 if summary["failed_runs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
