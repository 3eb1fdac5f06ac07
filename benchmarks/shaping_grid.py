"""The report's §3.5.2.2 stability grid, scaled to this machine: a SPARTA swarm on emulated hosts
(``local.hosts``: one network namespace per node) with its contributors' links shaped per cell.

Cells (``--cells``, default the report's): RTT 0, 20, 40, 60, 80, 100, 120 ms at 200 Mbit/s, and 50 and
100 Mbit/s at 100 ms. Each cell is one ``launch swarm`` of the surrogate model (report §3.5.1.1: linear
stages, ``model.surrogate.dummy_params`` inflating the all-reduce payload) with ``--stages`` stages of 2
workers, the second of each a contributor on the shaped link (workers unshaped, as in the report), and one
trainer; SPARTA every ``--every`` steps. Needs root (namespaces) and takes minutes per cell.

Per cell, from the workers' round records: ``allreduce_s`` (median duration of rounds that averaged),
``completeness`` (mean fraction of a worker's averaged parts that came back, failed rounds 0),
``failed_pct`` (rounds with completeness below 100%, the report's definition), ``rounds``; from the run
report ``tokens_per_s``; and ``predicted_tokens_per_s``: the ceiling that ``manifest plan``'s §3.5.2.1
formula puts on a contributor at that bandwidth — (bandwidth − the all-reduce's share at
``ar_time_s``) / (32·(a_f+a_b)·seq_len·hidden) activation pairs per second, times seq_len tokens and the
workers of a stage (a bandwidth bound; below it the swarm is compute-bound on these 2 cores).

    sudo python benchmarks/shaping_grid.py --json
    sudo python benchmarks/shaping_grid.py --cells 200:0,200:120,50:100 --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MANIFEST = ROOT / "manifests" / "local-cpu.yaml"
REPORT_CELLS = [(200, r) for r in (0, 20, 40, 60, 80, 100, 120)] + [(100, 100), (50, 100)]


def base_settings(args, data: list[str], run_dir: Path) -> list[str]:
    stages = ", ".join(["{role: head, layers: 1}"] + ["{role: body, layers: 1}"] * (args.stages - 2)
                       + ["{role: tail, layers: 1}"])
    return data + [
        "model.family=surrogate", "model.ssn.rank=null", f"model.n_layers={args.stages}", "model.d_model=64",
        "model.n_heads=4", "model.n_kv_heads=null", f"model.surrogate.dummy_params={args.dummy_params}",
        "model.seq_len=64", f"stages=[{stages}]", "training.global_batch_size=8", "workers.max_microbatch=8",
        "trainers.microbatch=1",
        f"training.max_steps={args.steps}", "training.schedule.warmup_steps=2", "workers.announce_period_s=1",
        "trainers.discovery_period_s=2", "trainers.request_timeout_s=30", "network.startup_timeout_s=150",
        "local.workers_per_stage=2", "local.trainers=1", "trainers.count=1", "local.max_restarts=0",
        "data_parallel.method=sparta", "data_parallel.sparta.fraction=0.25",
        f"data_parallel.sparta.every_steps={args.every}", "data_parallel.sparta.matchmaking_timeout_s=15",
        "checkpoints.every_steps=0", "checkpoints.snapshots_every_steps=0",
        f"checkpoints.store={run_dir / 'store'}", f"local.run_dir={run_dir}",
        "local.hosts.enabled=true", "local.hosts.contributors_per_stage=1",
    ]


def rounds_of(run_dir: Path) -> list[dict]:
    out = []
    for f in (run_dir / "swarm" / "nodes").glob("worker-*.json"):
        try:
            out += json.loads(f.read_text()).get("rounds", [])
        except (OSError, ValueError):
            pass
    return [r for r in out if r.get("status") in ("complete", "partial", "failed")]


def predicted_tokens_per_s(values: list[str], mbps: float, workers: int) -> float:
    from agoractl.manifest.loader import load_manifest
    from agoractl.manifest.plan import make_plan

    run = load_manifest(MANIFEST, values)
    plan = make_plan(run)
    need = plan["required_bandwidth_mbps"]  # at a_f = a_b = 3 activation pairs per second
    a = plan["assumptions"]
    activation_mbps = 32 * (a["a_f"] + a["a_b"]) * run.model.seq_len * (run.model.ssn.rank or run.model.d_model) / 1e6
    ar_mbps = need["fp32"] - activation_mbps
    pairs_per_s = max(0.0, mbps - ar_mbps) / (activation_mbps / (a["a_f"]))  # a_f = a_b: pairs per second
    return round(pairs_per_s * run.model.seq_len * workers, 1)


def cell(args, tmp: Path, mbps: float, rtt: float) -> dict:
    run_dir = tmp / f"cell-{mbps:g}-{rtt:g}"
    # each cell reads its own copy of the shards, without claims: its trainer reads from the beginning
    shutil.copytree(tmp / "shards", run_dir / "shards", ignore=shutil.ignore_patterns("claims"))
    data = [f"data.source={tmp / 'sample'}/*.parquet", f"data.output={run_dir / 'shards'}", "data.num_shards=4"]
    values = base_settings(args, data, run_dir) + [
        f"local.hosts.shaping=[{{kind: worker, role: contributor, bandwidth_mbps: {mbps}, rtt_ms: {rtt}}}]"]
    argv = [sys.executable, "-m", "agoractl", "launch", "swarm", str(MANIFEST),
            *[a for v in values for a in ("--set", v)],
            "--json"]
    t = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.cell_timeout_s, cwd=ROOT)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-2000:])
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    rounds = rounds_of(run_dir)
    done = [r for r in rounds if r["status"] != "failed"]
    success = [float(r.get("averaging_success") or 0.0) for r in rounds]
    return {
        "bandwidth_mbps": mbps, "rtt_ms": rtt,
        "allreduce_s": round(statistics.median(r["duration_s"] for r in done), 3) if done else None,
        "completeness": round(statistics.mean(success), 3) if success else None,
        "failed_pct": round(100.0 * sum(s < 1.0 for s in success) / len(success), 1) if success else None,
        "rounds": len(rounds),
        "tokens_per_s": round(report.get("tokens_per_s", 0.0), 1) if report else None,
        "predicted_tokens_per_s": predicted_tokens_per_s(values, mbps, 2),
        "steps": report.get("steps"), "samples_lost": report.get("samples_lost"),
        "exit_code": proc.returncode, "wall_s": round(time.monotonic() - t, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default=None, help="MBPS:RTT_MS,... (default: the report's 9 cells)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=4, help="SPARTA every this many steps")
    p.add_argument("--dummy-params", type=int, default=8_000_000,
                   help="all-reduce payload per stage, params (at 2M, 50-200 Mbit/s differ by less than noise)")
    p.add_argument("--cell-timeout-s", type=float, default=1200)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    cells = ([tuple(float(x) for x in c.split(":")) for c in args.cells.split(",")] if args.cells else REPORT_CELLS)
    with tempfile.TemporaryDirectory(prefix="shaping-grid-") as tmp:
        tmp = Path(tmp)
        agoractl = [sys.executable, "-m", "agoractl"]
        subprocess.run([*agoractl, "data", "sample", "--out", str(tmp / "sample"), "--rows", "2000", "--files", "2",
                        "--json"], check=True, capture_output=True, cwd=ROOT)
        subprocess.run([*agoractl, "shard", str(MANIFEST), "--set", f"data.source={tmp / 'sample'}/*.parquet",
                        "--set", f"data.output={tmp / 'shards'}", "--set", "data.num_shards=4", "--json"],
                       check=True, capture_output=True, cwd=ROOT)
        out = {"cells": []}
        for mbps, rtt in cells:
            out["cells"].append(cell(args, tmp, mbps, rtt))
            if not args.json:
                print(json.dumps(out["cells"][-1]), flush=True)
    out["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    if args.json:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
