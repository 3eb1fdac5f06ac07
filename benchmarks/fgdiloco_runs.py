"""Consecutive FGDiLoCo swarm runs: does every outer round's mixing complete, on time, and say truthfully what
it received? (issue 24: 20 consecutive runs with no failed or stalled Mix2, every round's reported success
consistent with its received bytes).

Runs ``agoractl launch swarm`` of a FGDiLoCo manifest (default ``manifests/fgdiloco-dp-cpu.yaml``, whole-model
replicas; ``--manifest manifests/fgdiloco-local-cpu.yaml`` for the 2-stage pipeline) ``--runs`` times in a row,
the variants taken in turn (``--variant``, repeatable; default all four), each run from the data's beginning
(:func:`cli_runs.unread`) on a generated sample corpus. After each run it reads every worker's mix records
(``<run_dir>/swarm/nodes/*.json``, ``rounds``) and the run report, and counts:

- **failed mixes**: a Mix1 or Mix2 that ran (not skipped by design: ``none`` mixing, round 0 of a new run)
  whose status is not ``complete`` (``partial``, ``failed``, ``empty``);
- **stalled mixes**: one that took longer than ``--stall-s`` (default 5 s; a healthy one takes 0.05-0.5 s
  here, a stalled one waited out matchmaking, 40-50 s);
- **inconsistent records**: success above 0 on 0 bytes received, or ``complete`` with a success below 1;
- and whether the run itself was whole: exit 0, every step taken, no sample lost, every step's batch exact
  (``step_samples``).

``--transport direct|hivemind`` sets ``data_parallel.fgdiloco.transport`` (default: the manifest's). A run is
clean when all four are nil; the figure is the longest streak of clean runs and the count of clean
ones. JSON (``--out``) lists every run's figures (tokens/s, final loss, start-up to the first optimizer step,
mix durations, also Mix1's and Mix2's medians apart) and the summary.

    python benchmarks/fgdiloco_runs.py --runs 20 --out fgdiloco_runs.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cli_runs import sample_shards, sets, unread, write_json

from agoractl.algorithms.fgdiloco import VARIANTS

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "manifests" / "fgdiloco-dp-cpu.yaml"


def mix_records(run_dir: Path) -> list[dict]:
    """Every mix record of every worker of the run (restarted workers included)."""
    out = []
    for f in sorted((run_dir / "swarm" / "nodes").glob("worker-*.json")):
        for rec in json.loads(f.read_text()).get("rounds", []):
            out.append({**rec, "worker": f.stem})
    return out


def judge(report: dict, records: list[dict], stall_s: float) -> dict:
    """One run's figures and its problems (see the module docstring)."""
    ran = [r for r in records if r.get("status") != "skipped"]
    failed = [r for r in ran if r.get("status") != "complete"]
    stalled = [r for r in ran if (r.get("duration_s") or 0.0) > stall_s]
    inconsistent = [r for r in ran if ((r.get("averaging_success") or 0) > 0 and not r.get("bytes_received"))
                    or (r.get("status") == "complete" and (r.get("averaging_success") or 0) < 1.0)]
    batch = report.get("global_batch_size")
    whole = (report.get("completed") is True and report.get("samples_lost") == 0
             and report.get("step_samples") == {"min": batch, "max": batch, "mean": float(batch)})
    brief = lambda rs: [{k: r.get(k) for k in ("worker", "mix", "round", "status", "averaging_success",
                                               "bytes_received", "duration_s", "error")} for r in rs]
    durations = sorted(r["duration_s"] for r in ran if r.get("duration_s") is not None)
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
    by_mix = {m: median([r["duration_s"] for r in ran if r.get("mix") == m and r.get("duration_s") is not None])
              for m in ("mix1", "mix2")}
    return {"tokens_per_s": round(report.get("tokens_per_s", 0.0), 1), "final_loss": report.get("final_loss"),
            "startup_s": report.get("startup_s"), "end_reason": report.get("end_reason"),
            "step_samples": report.get("step_samples"), "samples_lost": report.get("samples_lost"),
            "mixes": len(ran), "mix_s_median": durations[len(durations) // 2] if durations else None,
            "mix_s_max": durations[-1] if durations else None,
            "mix1_s_median": by_mix["mix1"], "mix2_s_median": by_mix["mix2"],
            "failed": brief(failed), "stalled": brief(stalled), "inconsistent": brief(inconsistent),
            "run_whole": whole, "clean": whole and not (failed or stalled or inconsistent)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", type=Path, default=MANIFEST, help="a FGDiLoCo run")
    p.add_argument("--runs", type=int, default=20, help="consecutive swarm runs")
    p.add_argument("--variant", dest="variants", action="append", choices=list(VARIANTS),
                   help="variants taken in turn (repeatable); default all four")
    p.add_argument("--stall-s", type=float, default=5.0, help="a mix longer than this is stalled")
    p.add_argument("--transport", choices=["direct", "hivemind"], help="data_parallel.fgdiloco.transport")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="manifest override (repeatable)")
    p.add_argument("--out", type=Path, help="write the JSON here")
    a = p.parse_args(argv)
    if a.runs < 1:
        print("error: --runs must be at least 1", file=sys.stderr)
        return 2
    variants = a.variants or list(VARIANTS)
    runs, streak, best = [], 0, 0
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fgdiloco-runs-") as tmp:
        tmp = Path(tmp)
        transport = [f"data_parallel.fgdiloco.transport={a.transport}"] if a.transport else []
        data = sample_shards(tmp, a.manifest) + transport + a.overrides
        for i in range(a.runs):
            v = variants[i % len(variants)]
            unread(tmp / "shards")
            where = tmp / f"run-{i}"
            t0 = time.time()
            proc = subprocess.run([sys.executable, "-m", "agoractl", "launch", "swarm", str(a.manifest), "--fresh",
                                   "--force", "--json", *sets(data + [f"data_parallel.fgdiloco.variant={v}",
                                                                      f"local.run_dir={where}",
                                                                      f"checkpoints.store={where / 'store'}"])],
                                  capture_output=True, text=True, cwd=ROOT, timeout=1800)
            if proc.returncode == 0:
                fig = judge(json.loads(proc.stdout), mix_records(where), a.stall_s)
            else:
                last = proc.stderr.strip().splitlines()[-1:]
                fig = {"clean": False, "exit_code": proc.returncode, "error": last[0] if last else ""}
            fig.update(run=i + 1, variant=v, wall_s=round(time.time() - t0, 1))
            runs.append(fig)
            streak = streak + 1 if fig["clean"] else 0
            best = max(best, streak)
            print(f"run {i + 1}/{a.runs} {v}: " + ("clean" if fig["clean"] else "NOT CLEAN") +
                  (f", {fig['tokens_per_s']:,.0f} tokens/s, loss {fig['final_loss']:.4f}, {fig['mixes']} mixes "
                   f"(median {fig['mix_s_median']} s, max {fig['mix_s_max']} s), start-up {fig['startup_s']} s"
                   if "mixes" in fig else f": exit {fig['exit_code']} {fig['error']}"), file=sys.stderr, flush=True)
    summary = {"runs": a.runs, "clean": sum(r["clean"] for r in runs), "longest_clean_streak": best,
               "failed_mixes": sum(len(r.get("failed", [])) for r in runs),
               "stalled_mixes": sum(len(r.get("stalled", [])) for r in runs),
               "inconsistent_records": sum(len(r.get("inconsistent", [])) for r in runs),
               "mixes": sum(r.get("mixes", 0) for r in runs)}
    result = {"manifest": str(a.manifest), "transport": a.transport, "variants": variants, "overrides": a.overrides,
              "stall_s": a.stall_s,
              "machine": {"cpus": os.cpu_count(), "load_avg_1m_before": round(load_before, 2),
                          "load_avg_1m_after": round(os.getloadavg()[0], 2)},
              "summary": summary, "runs": runs}
    if a.out is not None:
        write_json(a.out, result)
    print(json.dumps(summary))
    return 0 if summary["clean"] == a.runs else 1


if __name__ == "__main__":
    sys.exit(main())
