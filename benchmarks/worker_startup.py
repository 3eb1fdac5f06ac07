"""Start-up cost of a node: a worker process's CPU seconds to its "worker ready" line, and the wall
time of ``agoractl --help``, for this tree and optionally a baseline tree in the same run.

Each tree gets its own DHT seed (``agoractl launch dht``); each sample starts one worker of the
first stage joined to it, waits for the "worker ready" log line, stops it with SIGTERM and reads
``cpu_at_ready_s`` from its ``--stats`` file (the worker process itself, its DHT process and p2pd).
Samples of the two trees alternate, so load on the machine hits both alike; medians are reported.

    python benchmarks/worker_startup.py                                  # this tree
    git archive main | tar -x -C /tmp/base
    python benchmarks/worker_startup.py --baseline /tmp/base --runs 5    # this tree vs /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READY = "worker ready"


def _env(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "AGORA_DEBUG": ""}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "agoractl", *args]


def start_dht(tree: Path, manifest: Path, out_dir: Path) -> tuple[subprocess.Popen, str]:
    """A DHT seed from `tree`; returns the process and the multiaddr to join."""
    out = out_dir / "dht.out"
    p = subprocess.Popen(_cli("launch", "dht", str(manifest), "--json"), cwd=tree, env=_env(tree),
                         stdout=open(out, "wb"), stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            return p, json.loads(out.read_text())["maddrs"][0]
        except (ValueError, KeyError, OSError):
            if p.poll() is not None:
                raise SystemExit(f"the DHT seed of {tree} exited with {p.returncode}")
            time.sleep(0.2)
    p.kill()
    raise SystemExit(f"the DHT seed of {tree} printed no multiaddr in 120 s")


def worker_cpu_to_ready(tree: Path, manifest: Path, maddr: str, out_dir: Path, i: int) -> dict:
    """One worker from `tree`: CPU seconds at its "worker ready" line (node, dht, p2pd), wall seconds."""
    stats = out_dir / f"worker-{i}.json"
    t0 = time.monotonic()
    p = subprocess.Popen(_cli("launch", "worker", str(manifest), "--stage", "auto", "--initial-peers", maddr,
                              "--stats", str(stats), "--set", f"checkpoints.store={out_dir / f'store-{i}'}",
                              "--set", f"local.run_dir={out_dir / f'run-{i}'}"),
                         cwd=tree, env=_env(tree), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         start_new_session=True, text=True)
    wall = None
    try:
        for line in p.stderr:
            if READY in line:
                wall = time.monotonic() - t0
                break
        if wall is None:
            raise SystemExit(f"a worker of {tree} exited with {p.wait()} before it was ready")
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    cpu = json.loads(stats.read_text())["cpu_at_ready_s"]
    return {"node": cpu["node"], "total": sum(cpu.values()), "wall_s": wall}


def help_wall(tree: Path) -> float:
    t0 = time.monotonic()
    subprocess.run(_cli("--help"), cwd=tree, env=_env(tree), stdout=subprocess.DEVNULL, check=True)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="another source tree (e.g. main, unpacked) to compare with")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--manifest", default="manifests/local-cpu.yaml")
    ap.add_argument("--out", type=Path, help="write the JSON here as well as to stdout")
    args = ap.parse_args()
    trees = {"this": ROOT}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    samples: dict[str, dict[str, list]] = {k: {"worker": [], "help_s": []} for k in trees}
    with tempfile.TemporaryDirectory(prefix="worker-startup-") as tmp:
        dhts = {}
        try:
            for name, tree in trees.items():
                d = Path(tmp) / name
                d.mkdir()
                dhts[name] = start_dht(tree, tree / args.manifest, d)
            for i in range(args.runs):
                for name, tree in trees.items():
                    samples[name]["help_s"].append(help_wall(tree))
                    samples[name]["worker"].append(
                        worker_cpu_to_ready(tree, tree / args.manifest, dhts[name][1], Path(tmp) / name, i))
                    print(f"{name} run {i}: {samples[name]['worker'][-1]}", file=sys.stderr)
        finally:
            for p, _ in dhts.values():
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(30)
    out: dict = {"runs": args.runs, "cpus": os.cpu_count()}
    for name, s in samples.items():
        out[name] = {"tree": str(trees[name]),
                     "worker_cpu_to_ready_node_s": statistics.median(w["node"] for w in s["worker"]),
                     "worker_cpu_to_ready_total_s": statistics.median(w["total"] for w in s["worker"]),
                     "worker_wall_to_ready_s": statistics.median(w["wall_s"] for w in s["worker"]),
                     "help_wall_s": statistics.median(s["help_s"]), "samples": s}
    if "baseline" in out:
        for key in ("worker_cpu_to_ready_node_s", "worker_cpu_to_ready_total_s", "help_wall_s"):
            out[f"delta_{key}"] = out["this"][key] - out["baseline"][key]
            out[f"ratio_{key}"] = out["this"][key] / out["baseline"][key]
    text = json.dumps(out, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
