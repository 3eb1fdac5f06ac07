"""Churn soak: a SPARTA swarm under ``agoractl ops churn`` (a worker SIGKILLed and replaced every
``--every`` seconds, default 60) for ``--minutes`` (default 30), against ``launch central`` on the same tokens.

The swarm trains ``manifests/local-cpu.yaml`` (plus any ``--set``) with ``local.workers_per_stage``
workers per stage and no step limit; after ``--minutes`` it is stopped with SIGINT (its report is written
with the steps it completed), and ``launch central`` then trains exactly that many steps of the same global
batch from the same corpus. With ``--hosts`` every node runs on its own emulated host (root only). Not part
of the test suite: it takes the whole duration plus the central run.

JSON: ``swarm_final_loss`` and ``central_final_loss`` (mean of the last 5 steps' losses at equal tokens),
``loss_gap_pct`` (swarm over central, in %), the same over the last 50 steps (``*_last_50``: steadier),
``steps``, ``tokens``, ``samples_lost``, ``end_reason``, ``averaging_rounds`` and ``averaging_success`` (per
stage), ``replacements`` (churn events) and ``joins_completed`` (newcomers whose DHT record served before the
end). Central trains in a store of its own.

    python benchmarks/churn_soak.py --json
    python benchmarks/churn_soak.py --minutes 5 --every 20 --json
    python benchmarks/churn_soak.py --no-churn --json    # the control: the swarm's own gap, nobody killed
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "manifests" / "local-cpu.yaml"
SETTINGS = [
    "model.seq_len=64", "training.global_batch_size=8", "workers.max_microbatch=8", "trainers.microbatch=1",
    "training.max_steps=1000000",
    "training.schedule.kind=constant", "training.schedule.warmup_steps=5",
    "workers.announce_period_s=1", "trainers.discovery_period_s=2", "trainers.request_timeout_s=30",
    "network.startup_timeout_s=150", "local.workers_per_stage=3", "local.trainers=1", "trainers.count=1",
    # Half of each stage's weights averaged every 5 steps. Three replicas each stepping AdamW on a third of an
    # 8-sample batch drift apart between rounds, and the swarm's loss gap to central is theirs, not the churn's: the
    # simulator (no network, no churn, rounds applied 4 steps late) ends 2,600 steps 6.7% above central at fraction
    # 0.25 and 4.4% at 0.5 (last 300 steps); the real 30-minute soak measured +6.3% (last 50 steps) at 0.25 and
    # +3.0% at 0.5.
    "data_parallel.method=sparta", "data_parallel.sparta.fraction=0.5", "data_parallel.sparta.every_steps=5",
    "checkpoints.every_steps=20", "checkpoints.snapshots_every_steps=0", "local.stall_timeout_s=600",
]


def final_loss(report: dict, steps: int, last: int = 5) -> float | None:
    xs = [loss for step, loss in report.get("loss", []) if steps - last <= step < steps]
    return sum(xs) / len(xs) if xs else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--every", type=float, default=60.0, help="seconds between replacements")
    p.add_argument("--no-churn", action="store_true",
                   help="the control: the same swarm for the same minutes, nobody killed (the cost of the swarm itself)")
    p.add_argument("--hosts", action="store_true", help="every node on its own emulated host (root only)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra manifest override")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    agoractl = [sys.executable, "-m", "agoractl"]
    with tempfile.TemporaryDirectory(prefix="churn-soak-") as tmp:
        tmp = Path(tmp)
        subprocess.run([*agoractl, "data", "sample", "--out", str(tmp / "sample"), "--rows", "20000", "--files", "2",
                        "--json"], check=True, capture_output=True, cwd=ROOT)
        data = [f"data.source={tmp / 'sample'}/*.parquet", f"data.output={tmp / 'shards'}", "data.num_shards=4"]
        subprocess.run([*agoractl, "shard", str(MANIFEST), *[a for v in data for a in ("--set", v)], "--json"],
                       check=True, capture_output=True, cwd=ROOT)
        values = data + SETTINGS + args.sets + [f"checkpoints.store={tmp / 'store'}", f"local.run_dir={tmp / 'run'}"]
        if args.hosts:
            values.append("local.hosts.enabled=true")
        sets = [a for v in values for a in ("--set", v)]
        swarm = subprocess.Popen([*agoractl, "launch", "swarm", str(MANIFEST), *sets, "--json"], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=open(tmp / "swarm.err", "wb"), start_new_session=True)
        if args.no_churn:
            events = []
            time.sleep(args.minutes * 60)  # the run's length, as the churned run's (the schedule, not readiness)
        else:
            churn = subprocess.Popen([*agoractl, "ops", "churn", str(MANIFEST), *sets, "--every", str(args.every),
                                      "--for", str(args.minutes * 60), "--json"], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=open(tmp / "churn.err", "wb"))
            events = [json.loads(line) for line in churn.communicate()[0].decode().splitlines() if line.strip()]
            time.sleep(args.every / 2)  # let the last newcomer join before the end (the schedule, not readiness)
        os.killpg(swarm.pid, signal.SIGINT)
        out, _ = swarm.communicate(timeout=300)
        report = json.loads(out) if out.strip() else json.loads((tmp / "run" / "swarm-report.json").read_text())
        steps = int(report["steps"])
        central = json.loads(subprocess.run(
            [*agoractl, "launch", "central", str(MANIFEST), *sets, "--set", f"training.max_steps={steps}",
             "--set", f"local.run_dir={tmp / 'central'}", "--set", f"checkpoints.store={tmp / 'central-store'}",
             "--json"],
            capture_output=True, text=True, check=True, cwd=ROOT).stdout)
    swarm_loss, central_loss = final_loss(report, steps), final_loss(central, steps)
    # a step's loss is the mean over its 8 samples: the last 5 steps are 40 samples; 50 steps are steadier
    swarm_50, central_50 = final_loss(report, steps, 50), final_loss(central, steps, 50)
    result = {
        "minutes": args.minutes, "every_s": None if args.no_churn else args.every, "hosts": args.hosts, "steps": steps,
        "tokens": report.get("tokens"), "swarm_final_loss": swarm_loss, "central_final_loss": central_loss,
        "loss_gap_pct": round(100 * (swarm_loss - central_loss) / central_loss, 2) if swarm_loss and central_loss
        else None,
        "swarm_loss_last_50": swarm_50, "central_loss_last_50": central_50,
        "loss_gap_pct_last_50": round(100 * (swarm_50 - central_50) / central_50, 2) if swarm_50 and central_50
        else None,
        "samples_lost": report.get("samples_lost"), "end_reason": report.get("end_reason"),
        "averaging_rounds": {s["name"]: s.get("averaging_rounds") for s in report.get("stages", [])},
        "averaging_success": {s["name"]: s.get("averaging_success_mean") for s in report.get("stages", [])},
        "replacements": sum(e.get("event") == "replaced" for e in events),
        "joins_completed": sum(e.get("joined_s") is not None for e in report.get("churn", [])),
        "churn": report.get("churn", []),
    }
    print(json.dumps(result, indent=2 if args.json else None))


if __name__ == "__main__":
    main()
