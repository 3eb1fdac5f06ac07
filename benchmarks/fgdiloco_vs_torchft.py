"""agoractl's FGDiLoCo on whole-model replicas against the field's reference DiLoCo, torchft's (issue 24).

Both train ``manifests/fgdiloco-dp-cpu.yaml``'s model (a tiny Llama, not split) as 2 whole-model replicas
on the same generated sample corpus: global batch 8 (4 samples per replica per inner step), 40 inner steps,
H = 5, AdamW inner at the manifest's lr, betas and weight decay with its cosine schedule (warm-up 4) and
clipping at 1.0, outer SGD lr 0.7, momentum 0.9, Nesterov; every process at one torch thread.

- **torchft**: torchft 0.2.0's ``torchft.local_sgd.DiLoCo``, two replica groups (one process each) over gloo
  with torchft's lighthouse on loopback (``benchmarks/torchft_diloco.py``: the model, AdamW, schedule and
  clipping are ``launch central``'s, :class:`agoractl.training.central.Central`; replica ``r`` trains
  ``b[4r:4r + 4]`` of each global batch ``b`` of the data stream ``launch central`` reads: the swarm's split).
- **agoractl**: ``agoractl launch swarm <manifest> --fresh --force --set data_parallel.fgdiloco.variant=V``
  for each variant V (``diloco``: Mix2 global, the DiLoCo algorithm; ``global_m1``: Mix1 global, started in
  the background at the round's start; ``global_m1_local_m2`` on request): 2 workers (the replicas, each reading
  its own 4 samples per inner step: ``workers.self_feed``, the manifest's setting; ``--set workers.self_feed=false
  --set local.trainers=1`` measures trainer-fed replicas), a DHT, their p2pd daemons. The shards' claims are
  forgotten before each run (:func:`cli_runs.unread`), so every run trains from the data's beginning.

Per run: ``tokens_per_s`` over the training window (tokens of the 40 steps / seconds from the first step's
start to the last step's end: the swarm's first dispatch (its trainers', or its replicas' feeders'), torchft's
first inner step); ``final_loss``, the
mean of the last 5 steps' losses, a step's loss the mean over its global batch of 8 (both replicas);
``busy_cores``, the CPU seconds of every process of the run (launcher, lighthouse, replica groups; DHT, p2pd,
workers, trainers) read from ``/proc`` every 0.2 s, over the training window's seconds; ``startup_s``, from
launch to the window's start. The runs alternate torchft, then each agoractl variant, ``--repeats`` times.
Reported: medians per system/variant; each variant's tokens/s over the torchft run of the same repeat (the
median of those paired ratios), and its final loss's difference from torchft's in percent (paired, median).

Targets (issue 24): agoractl ``diloco`` at least 0.9x torchft's tokens/s, ``global_m1`` at least 1.1x, and
``diloco``'s final loss within 1% of torchft's.

    pip install -e '.[bench]'                                  # torchft==0.2.0 (the reference)
    python benchmarks/fgdiloco_vs_torchft.py                   # 5 repeats, a table
    python benchmarks/fgdiloco_vs_torchft.py --repeats 1 --variant diloco --variant global_m1 \\
        --variant global_m1_local_m2 --out fgdiloco_vs_torchft.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cli_runs import sample_shards, sets, unread, write_json
from swarm_vs_central import GroupCPU

from agoractl.algorithms.fgdiloco import VARIANTS

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "manifests" / "fgdiloco-dp-cpu.yaml"
TARGETS = {"diloco": 0.9, "global_m1": 1.1}
"""Issue 24: each variant's tokens/s over torchft's, at least."""
LOSS_TARGET_PCT = 1.0
"""Issue 24: agoractl diloco's final loss within this many percent of torchft's."""


def launch(cmd: list[str], timeout: float = 1800) -> dict:
    """Run `cmd` (it prints one JSON report) in its own session; the report, or ``{"failed": why}``, with
    ``_launched`` (wall time) and ``_cpu`` (:class:`GroupCPU` of its process groups)."""
    launched = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    cpu = GroupCPU(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
    finally:
        cpu.stop()
    if proc.returncode != 0:
        sys.stderr.write(err[-3000:])
        last = err.strip().splitlines()[-1:]
        report = {"failed": f"exit code {proc.returncode}: {last[0] if last else 'no output'}"}
    else:
        report = json.loads(out)
    report.update(_launched=launched, _cpu=cpu)
    return report


def measures(r: dict) -> dict:
    """The run's figures (see the module docstring), or its failure."""
    if "failed" in r:
        return {"failed": r["failed"]}
    if r["mode"] == "torchft":
        start = r["started_at"]
    else:  # the swarm's training window starts at its first dispatch (the report's elapsed_s counts from there)
        start = min(t["first_dispatch"] for t in r["trainers"] if t.get("first_dispatch"))
    cpu = r["_cpu"]
    out = {"tokens_per_s": round(r["tokens_per_s"], 1), "final_loss": r["final_loss"], "steps": r["steps"],
           "tokens": r["tokens"], "elapsed_s": r["elapsed_s"],
           "busy_cores": round(cpu.between(start, start + r["elapsed_s"]) / r["elapsed_s"], 2),
           "startup_s": round(start - r["_launched"], 2),
           "run_wall_s": round(cpu.timeline[-1][0] - r["_launched"], 2), "run_cpu_s": round(cpu.timeline[-1][1], 2),
           "loss": r["loss"]}
    if r["mode"] == "torchft":
        out["outer_commits"] = r["outer_commits"]
    else:
        stage = r["stages"][0]
        out.update({k: stage.get(k) for k in ("outer_rounds", "mix1_success_mean", "mix2_success_mean")},
                   samples_completed=r["samples_completed"], samples_lost=r["samples_lost"],
                   end_reason=r.get("end_reason"), step_samples=r.get("step_samples"),
                   startup_to_first_step_s=r.get("startup_s"))  # launch to the first optimizer step
    return out


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def summarize(runs: dict[str, list[dict]], variants: list[str]) -> dict:
    """Medians per arm; paired ratios and loss differences of each variant against torchft."""
    arms = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "failed" not in r]
        arms[name] = {"runs": len(rs), "failed": len(rs) - len(ok),
                      **{k: median([r[k] for r in ok]) for k in ("tokens_per_s", "final_loss", "busy_cores",
                                                                   "startup_s", "run_cpu_s")}}
    for v in variants:
        pairs = [(t, a) for t, a in zip(runs["torchft"], runs[v]) if "failed" not in t and "failed" not in a]
        ratios = [a["tokens_per_s"] / t["tokens_per_s"] for t, a in pairs]
        losses = [100 * (a["final_loss"] - t["final_loss"]) / t["final_loss"] for t, a in pairs]
        arms[v].update(ratio=median(ratios), ratios=[round(x, 3) for x in ratios],
                       loss_diff_pct=median(losses), loss_diffs_pct=[round(x, 2) for x in losses])
        if v in TARGETS:
            arms[v]["ratio_target"] = TARGETS[v]
            arms[v]["ratio_met"] = None if not ratios else statistics.median(ratios) >= TARGETS[v]
    if "diloco" in arms and arms["diloco"]["loss_diff_pct"] is not None:
        arms["diloco"]["loss_target_pct"] = LOSS_TARGET_PCT
        arms["diloco"]["loss_met"] = abs(arms["diloco"]["loss_diff_pct"]) <= LOSS_TARGET_PCT
    return arms


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", type=Path, default=MANIFEST, help="the run (one stage of role whole)")
    p.add_argument("--variant", dest="variants", action="append", choices=list(VARIANTS),
                   help="agoractl FGDiLoCo variant to run (repeatable); default diloco and global_m1")
    p.add_argument("--repeats", type=int, default=5, help="rounds of alternating runs (torchft, each variant)")
    p.add_argument("--rows", type=int, default=2000, help="documents in the generated sample corpus")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="manifest override for both systems (repeatable), e.g. training.max_steps=80")
    p.add_argument("--json", action="store_true", help="print the JSON on stdout instead of a table")
    p.add_argument("--out", type=Path, help="write the JSON to this file too")
    a = p.parse_args(argv)
    variants = a.variants or ["diloco", "global_m1"]
    if a.repeats < 1:
        print("error: --repeats must be at least 1", file=sys.stderr)
        return 2
    if importlib.util.find_spec("torchft") is None:
        print("error: torchft is not installed; run: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {"torchft": [], **{v: [] for v in variants}}
    with tempfile.TemporaryDirectory(prefix="fgdiloco-vs-torchft-") as tmp:
        tmp = Path(tmp)
        data = sample_shards(tmp, a.manifest, rows=a.rows) + a.overrides
        for i in range(a.repeats):
            r = launch([sys.executable, str(ROOT / "benchmarks" / "torchft_diloco.py"), "run", str(a.manifest),
                        *sets(data)])
            runs["torchft"].append(measures(r))
            for v in variants:
                unread(tmp / "shards")  # every swarm trains the same samples, from the data's beginning
                where = tmp / f"{v}-{i}"
                r = launch([sys.executable, "-m", "agoractl", "launch", "swarm", str(a.manifest), "--fresh",
                            "--force", "--json", *sets(data + [f"data_parallel.fgdiloco.variant={v}",
                                                               f"local.run_dir={where}",
                                                               f"checkpoints.store={where / 'store'}"])])
                runs[v].append(measures(r))
            for name in runs:
                m = runs[name][-1]
                print(f"repeat {i + 1}/{a.repeats} {name}: " + (f"FAILED {m['failed']}" if "failed" in m else
                      f"{m['tokens_per_s']:,.0f} tokens/s, loss {m['final_loss']:.4f}, {m['busy_cores']} cores, "
                      f"start-up {m['startup_s']} s"), file=sys.stderr, flush=True)
    result = {"manifest": str(a.manifest), "overrides": a.overrides, "variants": variants, "repeats": a.repeats,
              "machine": {"cpus": os.cpu_count(), "load_avg_1m_before": round(load_before, 2),
                          "load_avg_1m_after": round(os.getloadavg()[0], 2)},
              "summary": summarize(runs, variants), "runs": runs}
    if a.out is not None:
        write_json(a.out, result)
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    s, m = result["summary"], result["machine"]
    print(f"{a.manifest.name}: {a.repeats} repeat(s), {m['cpus']} CPUs (load {m['load_avg_1m_before']} -> "
          f"{m['load_avg_1m_after']}); medians, ratios paired with torchft's run of the same repeat")
    print(f"{'':20} {'tokens/s':>9} {'ratio':>6} {'target':>10} {'loss':>7} {'dloss %':>8} {'cores':>6} "
          f"{'start-up s':>10} {'failed':>6}")
    for name, x in s.items():
        def f(k, fmt):
            return format(x[k], fmt) if x.get(k) is not None else "-"
        target = f">={x['ratio_target']}{' NO' if x['ratio_met'] is False else ''}" if "ratio_target" in x else ""
        print(f"{name:20} {f('tokens_per_s', ',.0f'):>9} {f('ratio', '.2f'):>6} {target:>10} "
              f"{f('final_loss', '.4f'):>7} {f('loss_diff_pct', '+.2f'):>8} {f('busy_cores', '.2f'):>6} "
              f"{f('startup_s', '.1f'):>10} {x['failed']:>6}")
    if "loss_met" in s.get("diloco", {}):
        print(f"diloco final loss within {LOSS_TARGET_PCT}% of torchft's: {'yes' if s['diloco']['loss_met'] else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
