"""Re-sharding throughput: MB/s of parquet input re-sharded by `agoractl shard`'s engine, against a
plain pyarrow read-and-write copy of the same files, measured in the same run (the ratio is what
counts on a shared, noisy machine).

    .venv/bin/python benchmarks/shard_throughput.py            # a table
    .venv/bin/python benchmarks/shard_throughput.py --json     # one JSON object on stdout

The input is generated offline: FineWeb-Edu's schema, documents of a few KB (like FineWeb-Edu's)
assembled from the sample corpus's lessons, files with row groups of 1,000 rows. Both sides read
and write the same bytes on the same disk; each is run `--repeats` times, alternating, and the
fastest run counts (other processes on a shared machine only ever slow a run down, so the minimum
is the least noisy estimate of each side's speed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agoractl.data.sample import SCHEMA, document  # noqa: E402
from agoractl.data.shard import reshard  # noqa: E402
from agoractl.manifest.loader import load_manifest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def make_input(directory: Path, mb: float, files: int, seed: int = 0) -> int:
    """Write about `mb` MB of parquet; returns the rows written."""
    rng = random.Random(seed)
    lessons = [document(rng, i)[1] for i in range(2000)]
    rows_per_file, rows = None, 0
    directory.mkdir(parents=True, exist_ok=True)
    for k in range(files):
        cols: dict[str, list] = {n: [] for n in SCHEMA.names}
        size = 0
        target = mb * 1e6 / files * 2.6  # snappy shrinks this text about 2.6x
        i = 0
        while size < target if rows_per_file is None else i < rows_per_file:
            text = "\n\n".join(lessons[int(rng.random() * len(lessons))] for _ in range(8 + int(rng.random() * 8)))
            cols["text"].append(text)
            cols["id"].append(f"<urn:uuid:bench-{k}-{i}>")
            cols["dump"].append("CC-MAIN-2024-10")
            cols["url"].append(f"https://lessons.example.edu/{k}/{i}")
            cols["file_path"].append("s3://commoncrawl/crawl-data/CC-MAIN-2024-10/x.warc.gz")
            cols["language"].append("en")
            cols["language_score"].append(0.95)
            cols["token_count"].append(len(text) // 4)
            cols["score"].append(3.5)
            cols["int_score"].append(4)
            size += len(text)
            i += 1
        rows_per_file = rows_per_file or i
        rows += i
        pq.write_table(pa.Table.from_pydict(cols, schema=SCHEMA), directory / f"{k:03d}_00000.parquet",
                       row_group_size=1000, compression="snappy")
    return rows


def copy_files(src: Path, dst: Path) -> None:
    """The baseline: read each file with pyarrow and write it back out, same compression."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.glob("*.parquet")):
        pq.write_table(pq.read_table(f), dst / f.name, row_group_size=1000, compression="snappy")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=48, help="Input size, in MB of parquet (default 48).")
    ap.add_argument("--files", type=int, default=4, help="Input files (default 4).")
    ap.add_argument("--shards", type=int, default=16, help="Output shards (default 16).")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="Shard worker processes (default: CPUs).")
    ap.add_argument("--repeats", type=int, default=7, help="Runs of each side; the fastest counts (default 7).")
    ap.add_argument("--json", action="store_true", help="Print one JSON object on stdout.")
    ap.add_argument("--output", type=Path, help="Also write the JSON to this file.")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="agora-bench-") as tmp:
        tmp_path = Path(tmp)
        src = tmp_path / "src"
        rows = make_input(src, args.mb, args.files)
        input_bytes = sum(f.stat().st_size for f in src.glob("*.parquet"))
        run = load_manifest(ROOT / "manifests" / "local-cpu.yaml", [
            f"data.source={src}/*.parquet", f"data.output={tmp_path / 'shards'}", f"data.num_shards={args.shards}"])
        copy_s, shard_s = [], []
        for _ in range(args.repeats):  # alternate, so drifting machine load hits both sides alike
            shutil.rmtree(tmp_path / "copy", ignore_errors=True)
            copy_s.append(timed(lambda: copy_files(src, tmp_path / "copy")))
            shutil.rmtree(tmp_path / "shards", ignore_errors=True)
            shard_s.append(timed(lambda: reshard(run, jobs=args.jobs)))
        mb = input_bytes / 1e6
        copy_mbps, shard_mbps = mb / min(copy_s), mb / min(shard_s)
        result = {
            "shard_mb_per_s": round(shard_mbps, 2), "copy_mb_per_s": round(copy_mbps, 2),
            "ratio": round(shard_mbps / copy_mbps, 3), "input_mb": round(mb, 2), "rows": rows,
            "files": args.files, "shards": args.shards, "jobs": args.jobs, "repeats": args.repeats,
            "shard_seconds": [round(s, 3) for s in shard_s], "copy_seconds": [round(s, 3) for s in copy_s],
            "cpus": os.cpu_count(),
        }
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"input: {result['input_mb']} MB parquet, {rows} documents in {args.files} files -> {args.shards} shards, "
          f"{args.jobs} jobs, fastest of {args.repeats}")
    print(f"{'':24}{'MB/s':>10}{'seconds':>10}")
    print(f"{'agoractl shard':24}{shard_mbps:10.2f}{min(shard_s):10.2f}")
    print(f"{'pyarrow copy (baseline)':24}{copy_mbps:10.2f}{min(copy_s):10.2f}")
    print(f"ratio: {result['ratio']:.3f}")


if __name__ == "__main__":
    main()
