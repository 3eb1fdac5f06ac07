"""Swarm against centralized training on equal hardware: ``launch swarm`` and ``launch central`` on the
same tokens, on this machine, in the same run (report §5.4: the Pluralis-8B run reached 63% of a
centralized baseline's efficiency, over the internet).

Two shapes, each trained for the same steps of the same global batch on the same generated sample corpus:
``manifests/local-cpu.yaml`` (the tiny demo model, where a request's fixed cost dominates) and
``manifests/bench-cpu.yaml`` (d_model 256, compute-bound), each as shipped (its trainers' request size and
requests in flight; ``--microbatch``/``--in-flight``/``--set`` override them). Per shape and repeat, central
runs once per torch thread count 1..N (N = this machine's cores, the cores the swarm's processes share) and
the best of those counts is its equal-hardware figure; then the swarm runs. ``ratio`` is the median over repeats
of swarm/central tokens/s of each pair (a machine's speed drifts over minutes, so each swarm run is
compared with the central runs just before it); ``central_threads`` is the thread count of the median
central run. ``tokens_per_s`` is each report's own (§5.4.0.1: tokens of the completed steps over the
training time, start-up excluded on both sides).

``cpu_efficiency_ratio`` is tokens per CPU-second, swarm over central's best over its thread counts
(fewer threads waste less CPU: usually 1, ``central_cpu_threads``; median of the pairs): the CPU
seconds are read from ``/proc`` every 0.2 s for every process of each run's process groups (the swarm's
launcher, workers, trainers, their DHT processes and p2pd daemons; the central process), and counted over
the training window only (from the first dispatch to the last stage's last step; central: its training
loop), the window tokens/s counts. The swarm's profile (its nodes' own accounts) says where its CPU goes; each
repeat also runs the same workers' compute in one process on one thread (``benchmarks/worker_inprocess.py``,
just before the swarm: this machine's speed drifts), and ``crowding_ratio`` is the swarm's compute CPU per sample
over that: what sharing the cores with the other nodes and daemons costs the compute itself.

    python benchmarks/swarm_vs_central.py                 # a table per shape
    python benchmarks/swarm_vs_central.py --json          # {"shapes": {"local-cpu.yaml": {...}, ...}}
    python benchmarks/swarm_vs_central.py --set workers.activation_cache_mb=0   # the stateless recompute
    python benchmarks/swarm_vs_central.py --alt-set workers.activation_cache_mb=0  # both, paired in one run
    python benchmarks/swarm_vs_central.py --microbatch 1 --in-flight 16  # the report's single-sample requests
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ("local-cpu.yaml", "bench-cpu.yaml")
TICK = os.sysconf("SC_CLK_TCK")


class GroupCPU:
    """CPU seconds over time of every process in a launched process's groups: its own (it leads one) and
    that of each of its children (swarm nodes lead theirs), children of those included; polled from /proc.
    A process's last reading stands after it exits."""

    def __init__(self, leader: int, period: float = 0.2):
        self.leader, self.period = leader, period
        self.last: dict[tuple[int, int], float] = {}  # (pid, start time) -> CPU seconds
        self.timeline: list[tuple[float, float]] = []  # (wall time, CPU seconds of every process so far)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    @staticmethod
    def _stats() -> list[tuple[int, int, int, int, float]]:
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    raw = f.read().decode(errors="replace")
            except OSError:
                continue
            fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) ": state is fields[0]
            out.append((int(entry), int(fields[1]), int(fields[2]), int(fields[19]),
                        (int(fields[11]) + int(fields[12])) / TICK))
        return out

    def sample(self) -> None:
        procs = self._stats()
        groups = {self.leader} | {pgrp for pid, ppid, pgrp, _, _ in procs if ppid == self.leader}
        for pid, _, pgrp, start, cpu in procs:
            if pgrp in groups:
                self.last[(pid, start)] = cpu
        self.timeline.append((time.time(), sum(self.last.values())))

    def _poll(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> float:
        """CPU seconds of the groups at wall time `t`, interpolated between readings."""
        times = [p[0] for p in self.timeline]
        i = bisect.bisect_left(times, t)
        if i == 0:
            return self.timeline[0][1]
        if i >= len(times):
            return self.timeline[-1][1]
        (t0, c0), (t1, c1) = self.timeline[i - 1], self.timeline[i]
        return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)

    def between(self, a: float, b: float) -> float:
        return self.at(b) - self.at(a)


def agoractl(*args: str, timeout: float = 1800) -> dict:
    """Run an agoractl command with --json in its own process group; its JSON output, with ``_cpu``
    (the :class:`GroupCPU` of the run)."""
    proc = subprocess.Popen([sys.executable, "-m", "agoractl", *args, "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    cpu = GroupCPU(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        cpu.stop()
    if proc.returncode != 0:
        sys.stderr.write(err[-3000:])
        raise SystemExit(f"agoractl {' '.join(args[:2])} failed with exit code {proc.returncode}")
    report = json.loads(out)
    report["_cpu"] = cpu
    return report


def window(report: dict) -> tuple[float, float]:
    """The training window (wall times) that tokens_per_s counts."""
    if report["mode"] == "central":
        start = report["started_at"]
    else:
        start = min(t["first_dispatch"] for t in report["trainers"] if t.get("first_dispatch"))
    return start, start + report["elapsed_s"]


def tokens_per_cpu_s(report: dict) -> float:
    return report["tokens"] / max(report["_cpu"].between(*window(report)), 1e-9)


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]


def swarm_profile(report: dict) -> dict:
    """CPU seconds during training, by component, per completed sample (ms), from the nodes' stats."""
    parts: dict[str, float] = {}

    def add(name: str, end: dict, start: dict) -> None:
        for k, v in end.items():
            parts[f"{name}_{k}"] = parts.get(f"{name}_{k}", 0.0) + v - (start or {}).get(k, 0.0)

    compute = compute_cpu = 0.0
    for w in report.get("workers", []):
        if w.get("cpu_s"):  # None for a killed worker (its last DHT record stands in)
            add("worker", w["cpu_s"], w.get("cpu_at_first_request_s") or w.get("cpu_at_ready_s"))
            compute += w.get("compute_s", 0.0)
            compute_cpu += w.get("compute_cpu_s", 0.0)
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
        "worker_compute_cpu_ms_per_sample": round(compute_cpu / samples * 1000, 2),
        "mean_coalesced": {w["stage"]: round(w["coalesced_sum"] / max(1, sum(w["batches"].values())), 2)
                           for w in report.get("workers", []) if not w.get("killed")},
    }


def in_process(manifest: Path, overrides: list[str], steps: int = 2) -> dict:
    """The same workers' compute in one process on one thread, just before the swarm runs
    (:mod:`benchmarks.worker_inprocess`): what the swarm's compute would cost without the crowding."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "worker_inprocess.py"), str(manifest),
                           *[a for s in overrides for a in ("--set", s)], "--steps", str(steps), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"worker_inprocess.py failed with exit code {proc.returncode}")
    return json.loads(proc.stdout)


def alt_arm(sets: list[str], central: list[dict], frugal: list[dict], runs: list[dict]) -> dict:
    """The second swarm arm (--alt-set) against the same central runs."""
    a = median_run(runs)
    return {
        "sets": sets,
        "ratio": round(statistics.median(r["tokens_per_s"] / c["tokens_per_s"] for c, r in zip(central, runs)), 3),
        "cpu_efficiency_ratio": round(statistics.median(tokens_per_cpu_s(r) / tokens_per_cpu_s(c)
                                                        for c, r in zip(frugal, runs)), 3),
        "swarm_tokens_per_s": round(a["tokens_per_s"], 1),
        "swarm_tokens_per_cpu_s": round(tokens_per_cpu_s(a), 1),
        "swarm_final_loss": a["final_loss"],
        "all_runs": {"swarm_tokens_per_s": [round(r["tokens_per_s"], 1) for r in runs],
                     "swarm_tokens_per_cpu_s": [round(tokens_per_cpu_s(r), 1) for r in runs]},
        "proc_cpu_ms_per_sample": round(a["_cpu"].between(*window(a)) / max(1, a["samples_completed"]) * 1000, 2),
        "cpu_ms_per_sample": swarm_profile(a)["cpu_ms_per_sample"],  # by component, as the shipped arm's profile
        "peak_rss_mb": {w["stage"]: w.get("peak_rss_mb") for w in a.get("workers", [])},
    }


def run_shape(name: str, tmp: str, args, overrides: list[str]) -> dict:
    """Paired runs of one manifest: per repeat central at 1..N threads, then the swarm."""
    manifest = ROOT / "manifests" / name
    data = [f"data.source={tmp}/sample/*.parquet", f"data.output={tmp}/shards-{name}", "data.num_shards=4"]
    agoractl("shard", str(manifest), *[a for s in data for a in ("--set", s)])
    # Every artefact stays in the temporary directory (the store too); each run starts over (--fresh
    # --force: the previous run's checkpoints are moved aside, not resumed).
    sets = [a for s in data + [f"local.run_dir={tmp}/run-{name}", f"checkpoints.store={tmp}/store-{name}"]
            + overrides for a in ("--set", s)] + ["--fresh", "--force"]
    threads = list(range(1, (os.cpu_count() or 1) + 1)) if args.central_threads is None else [args.central_threads]
    central, swarm, frugal, alt = [], [], [], []  # per repeat: central's fastest and frugalest runs, the swarms'
    alone = []  # per repeat: the workers' compute in one process (CPU ms per sample)
    alt_sets = [a for s in args.alt_sets for a in ("--set", s)]
    for i in range(args.repeats):
        tries = []
        for n in threads:
            r = agoractl("launch", "central", str(manifest), *sets, "--threads", str(n))
            r["_threads"] = n
            tries.append(r)
            print(f"{name} central run {i + 1}, {n} thread(s): {r['tokens_per_s']:,.0f} tokens/s, "
                  f"{tokens_per_cpu_s(r):,.0f} tokens/CPU-s", file=sys.stderr, flush=True)
        central.append(max(tries, key=lambda r: r["tokens_per_s"]))
        frugal.append(max(tries, key=tokens_per_cpu_s))
        alone.append(in_process(manifest, overrides)["compute_cpu_ms_per_sample"])
        print(f"{name} workers' compute in one process, run {i + 1}: {alone[-1]} CPU ms per sample",
              file=sys.stderr, flush=True)
        arms = [(swarm, "swarm", [])] + ([(alt, "swarm --alt-set", alt_sets)] if alt_sets else [])
        for runs, label, extra in arms if i % 2 == 0 else arms[::-1]:  # the arms' order alternates too
            # from the data's beginning, as central reads it: forget the claims ledger (cli_runs.unread)
            shutil.rmtree(Path(tmp) / f"shards-{name}" / "claims", ignore_errors=True)
            runs.append(agoractl("launch", "swarm", str(manifest), *sets, *extra))
            print(f"{name} {label} run {i + 1}: {runs[-1]['tokens_per_s']:,.0f} tokens/s, "
                  f"{tokens_per_cpu_s(runs[-1]):,.0f} tokens/CPU-s", file=sys.stderr, flush=True)
    c, s = median_run(central), median_run(swarm)
    ratios = [sw["tokens_per_s"] / ce["tokens_per_s"] for ce, sw in zip(central, swarm)]
    cpu_ratios = [tokens_per_cpu_s(sw) / tokens_per_cpu_s(ce) for ce, sw in zip(frugal, swarm)]
    f = sorted(frugal, key=tokens_per_cpu_s)[(len(frugal) - 1) // 2]
    crowding = [swarm_profile(sw)["worker_compute_cpu_ms_per_sample"] / a for sw, a in zip(swarm, alone)]
    samples = max(1, s["samples_completed"])
    swarm_cpu = s["_cpu"].between(*window(s))
    central_cpu = c["_cpu"].between(*window(c))
    return {
        "ratio": round(statistics.median(ratios), 3),
        "cpu_efficiency_ratio": round(statistics.median(cpu_ratios), 3),
        "central_threads": c["_threads"],
        "central_tokens_per_s": round(c["tokens_per_s"], 1),
        "swarm_tokens_per_s": round(s["tokens_per_s"], 1),
        "central_final_loss": c["final_loss"],
        "swarm_final_loss": s["final_loss"],
        "central_tokens_per_cpu_s": round(tokens_per_cpu_s(f), 1),
        "central_cpu_threads": f["_threads"],
        "swarm_tokens_per_cpu_s": round(tokens_per_cpu_s(s), 1),
        "steps": s["steps"], "tokens": s["tokens"],
        "all_runs": {"central_tokens_per_s": [round(r["tokens_per_s"], 1) for r in central],
                     "central_threads": [r["_threads"] for r in central],
                     "central_tokens_per_cpu_s": [round(tokens_per_cpu_s(r), 1) for r in frugal],
                     "central_cpu_threads": [r["_threads"] for r in frugal],
                     "swarm_tokens_per_cpu_s": [round(tokens_per_cpu_s(r), 1) for r in swarm],
                     "swarm_tokens_per_s": [round(r["tokens_per_s"], 1) for r in swarm],
                     "ratios": [round(r, 3) for r in ratios],
                     "cpu_efficiency_ratios": [round(r, 3) for r in cpu_ratios],
                     "worker_compute_in_process_ms_per_sample": alone,
                     "crowding_ratios": [round(r, 3) for r in crowding]},
        "profile": {
            "central": {"elapsed_s": c["elapsed_s"], "cpu_s": round(central_cpu, 2),
                        "wall_ms_per_sample": round(c["elapsed_s"] / (c["steps"] * c["global_batch_size"]) * 1000, 2),
                        "cpu_ms_per_sample": round(central_cpu / (c["steps"] * c["global_batch_size"]) * 1000, 2)},
            "swarm": {**swarm_profile(s), "proc_cpu_s": round(swarm_cpu, 2),
                      "worker_compute_in_process_ms_per_sample": statistics.median(alone),
                      "crowding_ratio": round(statistics.median(crowding), 3),
                      "proc_cpu_ms_per_sample": round(swarm_cpu / samples * 1000, 2),
                      "wall_ms_per_sample": round(s["elapsed_s"] / samples * 1000, 2),
                      "peak_rss_mb": {w["stage"]: w.get("peak_rss_mb") for w in s.get("workers", [])},
                      "activation_cache": {w["stage"]: w.get("cache") for w in s.get("workers", []) if w.get("cache")}},
        },
        "swarm_stages": s["stages"],
        **({"alt": alt_arm(args.alt_sets, central, frugal, alt)} if alt else {}),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="Manifest override for every run (repeatable), e.g. workers.activation_cache_mb=0.")
    ap.add_argument("--shape", dest="shapes", action="append", choices=SHAPES,
                    help="Manifest(s) to run (repeatable); default both.")
    ap.add_argument("--microbatch", type=int, default=None,
                    help="Samples per trainer request in the swarm (trainers.microbatch); default the manifest's "
                         "(8 in both shapes: on these small models a request's fixed cost, libp2p and two p2pd "
                         "hops, outweighs a sample's compute). Pass 1 for the report's request shape.")
    ap.add_argument("--in-flight", type=int, default=None,
                    help="Requests each trainer keeps in flight (trainers.in_flight); default the manifest's. "
                         "Workers hold a forward of the next step's batch until their step "
                         "(workers.forward_hold_s), so more in flight than a batch costs no recompute.")
    ap.add_argument("--alt-set", dest="alt_sets", action="append", default=[],
                    help="A second swarm arm in every repeat with this override too (repeatable), reported under "
                         "`alt` against the same central runs, e.g. workers.activation_cache_mb=0.")
    ap.add_argument("--central-threads", type=int, default=None,
                    help="Only this torch thread count for central (default: its best of 1..cores).")
    ap.add_argument("--repeats", type=int, default=3,
                    help="Paired runs per shape; the medians count.")
    ap.add_argument("--rows", type=int, default=4000, help="Documents in the generated sample corpus.")
    ap.add_argument("--json", action="store_true", help="Print one JSON object on stdout.")
    args = ap.parse_args(argv)
    overrides = ([f"trainers.microbatch={args.microbatch}"] if args.microbatch else []) + (
        [f"trainers.in_flight={args.in_flight}"] if args.in_flight else []) + args.sets
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="swarm-vs-central-") as tmp:
        agoractl("data", "sample", "--out", f"{tmp}/sample", "--rows", str(args.rows), "--files", "2")
        shapes = {name: run_shape(name, tmp, args, overrides) for name in (args.shapes or SHAPES)}
    result = {
        "overrides": overrides,
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_before": round(load_before, 2),
                    "load_avg_1m_after": round(os.getloadavg()[0], 2)},
        "central_threads_tried": "one" if args.central_threads else f"1..{os.cpu_count()} (best of)",
        "shapes": shapes,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    m = result["machine"]
    print(f"{' '.join(overrides) or 'the manifests as shipped'}; {m['cpus']} CPUs "
          f"(load {m['load_avg_1m_before']} -> {m['load_avg_1m_after']}); "
          f"central: best of {result['central_threads_tried']} threads")
    for name, r in shapes.items():
        print(f"\n{name}: {r['steps']} steps, {r['tokens']:,} tokens")
        print(f"{'':8} {'tokens/s':>10} {'tok/CPU-s':>10} {'final loss':>11}   runs")
        print(f"{'central':8} {r['central_tokens_per_s']:>10,.0f} {r['central_tokens_per_cpu_s']:>10,.0f} "
              f"{r['central_final_loss']:>11.4f}   {r['all_runs']['central_tokens_per_s']} "
              f"threads {r['all_runs']['central_threads']}")
        print(f"{'swarm':8} {r['swarm_tokens_per_s']:>10,.0f} {r['swarm_tokens_per_cpu_s']:>10,.0f} "
              f"{r['swarm_final_loss']:>11.4f}   {r['all_runs']['swarm_tokens_per_s']}")
        print(f"ratio swarm/central: tokens/s {r['ratio']:.2f} {r['all_runs']['ratios']}, "
              f"CPU efficiency {r['cpu_efficiency_ratio']:.2f} {r['all_runs']['cpu_efficiency_ratios']} "
              f"(central at {r['central_cpu_threads']} thread(s))")
        prof = r["profile"]["swarm"]
        print(f"swarm profile: {prof['proc_cpu_s']} CPU s (/proc) in {prof['elapsed_s']} s; nodes' CPU ms per "
              f"sample: {prof['cpu_ms_per_sample']}; mean coalesced: {prof['mean_coalesced']}; "
              f"peak RSS MB {prof['peak_rss_mb']}")
        print(f"CPU ms per sample: central {r['profile']['central']['cpu_ms_per_sample']}, "
              f"swarm {prof['proc_cpu_ms_per_sample']}; the workers' compute "
              f"{prof['worker_compute_cpu_ms_per_sample']} "
              f"against {prof['worker_compute_in_process_ms_per_sample']} in one process (crowding x"
              f"{prof['crowding_ratio']}, {r['all_runs']['crowding_ratios']})")
        if "alt" in r:
            a = r["alt"]
            print(f"swarm with {' '.join(a['sets'])}: {a['swarm_tokens_per_s']:,.0f} tokens/s "
                  f"{a['all_runs']['swarm_tokens_per_s']}, ratio {a['ratio']:.2f}, CPU efficiency "
                  f"{a['cpu_efficiency_ratio']:.2f}, CPU ms per sample {a['proc_cpu_ms_per_sample']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
