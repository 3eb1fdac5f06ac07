"""Re-sharding on a Dask cluster beside the local executor, in the same run: MB/s with 1 and 2 workers
of a dask.distributed LocalCluster (worker processes on loopback) and `--executor local`, and the
peak memory of each worker at two input sizes (default 4.5x apart) with shards of the same size.

    .venv/bin/python benchmarks/shard_cluster.py            # a table
    .venv/bin/python benchmarks/shard_cluster.py --json     # one JSON object on stdout

Memory is the peak anonymous RSS (``RssAnon`` of /proc/PID/status: heap and Arrow buffers, not the
file-backed pages of memory-mapped spills or shared libraries, which the kernel can drop at will),
sampled every 10 ms in every worker process (the driver process for `local`). Re-sharding promises
a peak bounded by one unit and one shard, whatever the corpus size: so the larger input gets
proportionally more shards (same shard size) and the same unit size, and `rss_growth` (large over
small, per executor) should stay under 1.10. Spills and shards go to a local temporary directory
(shared by the workers of this one machine); against S3 the same tasks add the store's latency.
Each configuration runs `--repeats` times and the fastest counts (load from other processes only
ever slows a run). Input is generated offline as in benchmarks/shard_throughput.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distributed import LocalCluster  # noqa: E402

from agoractl.data.executors import DaskExecutor, LocalExecutor  # noqa: E402
from agoractl.data.shard import reshard  # noqa: E402
from agoractl.data.shard_plan import plan  # noqa: E402
from agoractl.manifest.loader import load_manifest  # noqa: E402
from benchmarks.shard_throughput import make_input  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def rss_anon(pid: int) -> int:
    """Anonymous resident bytes of process `pid` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakSampler:
    """Peak RssAnon of each of `pids`, sampled in a thread while the `with` block runs."""

    def __init__(self, pids: list[int], every_s: float = 0.01):
        self.pids, self.every_s = pids, every_s
        self.peak = {p: rss_anon(p) for p in pids}
        self.idle = dict(self.peak)
        self._stop = threading.Event()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for p in self.pids:
                self.peak[p] = max(self.peak[p], rss_anon(p))
            time.sleep(self.every_s)

    def __enter__(self) -> "PeakSampler":
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measure(run, executor, pids: list[int], out: Path, repeats: int, unit_bytes: int) -> dict:
    seconds, peaks, idle = [], [], []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        with PeakSampler(pids) as s:
            t0 = time.perf_counter()
            reshard(run, executor=executor, unit_bytes=unit_bytes)
            seconds.append(time.perf_counter() - t0)
        peaks.append(max(s.peak.values()))
        idle.append(max(s.idle.values()))
    return {"seconds": [round(x, 3) for x in seconds], "peak_rss_anon_mb": round(max(peaks) / 1e6, 1),
            "idle_rss_anon_mb": round(min(idle) / 1e6, 1), "fastest_s": min(seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=8, help="Smaller input, in MB of parquet (default 8).")
    ap.add_argument("--scale", type=float, default=4.5,
                    help="Larger input = --mb times this (default 4.5: at least 4x after parquet's rounding).")
    ap.add_argument("--shard-mb", type=float, default=0.5, help="Parquet MB per shard (default 0.5).")
    ap.add_argument("--unit-mb", type=float, default=4, help="Uncompressed MB of input per unit (default 4).")
    ap.add_argument("--repeats", type=int, default=3, help="Runs of each configuration; the fastest counts.")
    ap.add_argument("--json", action="store_true", help="Print one JSON object on stdout.")
    ap.add_argument("--output", type=Path, help="Also write the JSON to this file.")
    args = ap.parse_args()
    unit_bytes = int(args.unit_mb * 1e6)

    result: dict = {"sizes": {}, "cpus": os.cpu_count(), "unit_mb": args.unit_mb, "shard_mb": args.shard_mb,
                    "repeats": args.repeats}
    with tempfile.TemporaryDirectory(prefix="agora-bench-cluster-") as tmp:
        tmp_path = Path(tmp)
        runs = {}
        for label, mb in (("small", args.mb), ("large", args.mb * args.scale)):
            src = tmp_path / f"src-{label}"
            rows = make_input(src, mb, files=4, seed=1)
            input_bytes = sum(f.stat().st_size for f in src.glob("*.parquet"))
            shards = max(1, round(input_bytes / 1e6 / args.shard_mb))
            runs[label] = load_manifest(ROOT / "manifests" / "local-cpu.yaml", [
                f"data.source={src}/*.parquet", f"data.output={tmp_path / 'out'}", f"data.num_shards={shards}"])
            p = plan(runs[label], unit_bytes=unit_bytes)
            result["sizes"][label] = {"input_mb": round(input_bytes / 1e6, 2), "rows": rows, "shards": shards,
                                      "units": p["units"], "plan_memory_per_worker_mb":
                                      round(p["memory_per_worker_bytes"] / 1e6, 1), "executors": {}}
        configs = [("local-2-threads", None), ("dask-1-worker", 1), ("dask-2-workers", 2)]
        for name, workers in configs:
            cluster = None
            if workers is None:
                ex, pids = LocalExecutor(2), [os.getpid()]
            else:
                cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                                       dashboard_address=None, silence_logs=40)
                ex = DaskExecutor(cluster.scheduler_address)
                pids = list(ex.client.run(os.getpid).values())
            try:
                reshard(runs["small"], executor=ex, unit_bytes=unit_bytes)  # warm up: imports in each worker
                shutil.rmtree(tmp_path / "out", ignore_errors=True)
                for label, run in runs.items():  # small first: a larger peak later is not left over from it
                    m = measure(run, ex, pids, tmp_path / "out", args.repeats, unit_bytes)
                    size = result["sizes"][label]
                    m["mb_per_s"] = round(size["input_mb"] / m.pop("fastest_s"), 2)
                    size["executors"][name] = m
            finally:
                ex.close()
                if cluster is not None:
                    cluster.close()
    small, large = result["sizes"]["small"]["executors"], result["sizes"]["large"]["executors"]
    result["input_ratio"] = round(result["sizes"]["large"]["input_mb"] / result["sizes"]["small"]["input_mb"], 2)
    result["rss_growth"] = {n: round(large[n]["peak_rss_anon_mb"] / small[n]["peak_rss_anon_mb"], 3) for n in small}
    result["speedup_vs_local"] = {n: round(large[n]["mb_per_s"] / large["local-2-threads"]["mb_per_s"], 3)
                                  for n in large}
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for label, size in result["sizes"].items():
        print(f"{label}: {size['input_mb']} MB parquet, {size['rows']} documents -> {size['shards']} shards, "
              f"{size['units']} units; plan: <= {size['plan_memory_per_worker_mb']} MB per worker")
        print(f"  {'':18}{'MB/s':>8}{'peak RssAnon MB':>17}{'idle MB':>9}")
        for name, m in size["executors"].items():
            print(f"  {name:18}{m['mb_per_s']:8.2f}{m['peak_rss_anon_mb']:17.1f}{m['idle_rss_anon_mb']:9.1f}")
    print("peak RSS growth, large / small:", result["rss_growth"])


if __name__ == "__main__":
    main()
