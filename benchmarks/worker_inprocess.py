"""The swarm's worker compute without the swarm: every stage's :class:`~agoractl.training.worker.Worker` in one
process on one torch thread, fed the requests a swarm step brings (``trainers.microbatch`` samples each; every
forward of the step, then the tail's fused call and the backwards, as the forward hold orders them), and the
compute thread's CPU per sample counted as the workers count it (``compute_cpu_s``).

The same code in ``launch swarm`` spends more: its 3 workers, 2 trainers, their DHT processes and p2pd daemons
share the machine's cores, preempt each other, and each worker's caches go cold between its requests.
``benchmarks/swarm_vs_central.py`` reports both, so the profile separates that crowding from the compute
itself. Token ids are random (the cost depends on the shapes, not on the text).

    python benchmarks/worker_inprocess.py manifests/bench-cpu.yaml --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(manifest: str, overrides: list[str] = (), steps: int = 4) -> dict:
    """CPU ms per sample of each stage's compute over `steps` steps, after one warm-up step."""
    import torch

    from agoractl.manifest.loader import load_manifest
    from agoractl.training.worker import Task, Worker

    torch.set_num_threads(1)
    run = load_manifest(manifest, overrides)
    batch, micro = run.training.global_batch_size, run.trainers.microbatch
    workers = [Worker(run, i) for i in range(len(run.stage_names()))]
    head, body, tail = workers[0], workers[1:-1], workers[-1]
    if len(workers) < 2:
        raise SystemExit(f"{manifest}: the model is not split into stages")

    def call(worker: Worker, method: str, ids, wire=None, grad=None) -> dict:
        out: dict = {}
        worker._compute([Task(method, ids, wire, grad, lambda r, e: out.update(r=r, e=e))])
        if out["e"] is not None:
            raise out["e"]
        return out["r"]

    def step(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        requests = torch.randint(0, run.model.vocab_size - 1, (batch, run.model.seq_len + 1), generator=g).split(micro)
        inputs = []  # per request, each stage's input wire (None at the head)
        for ids in requests:
            wires = [None]
            for w in [head, *body]:
                wires.append(call(w, "forward", ids, wires[-1])["wire"])
            inputs.append(wires)
        for ids, wires in zip(requests, inputs):
            grad = call(tail, "forward_backward", ids, wires[-1])["grad"]
            for w, wire in zip(reversed([head, *body]), reversed(wires[:-1])):
                grad = call(w, "backward", ids, wire, grad).get("grad")
        for w in workers:
            if not w.maybe_step():
                raise RuntimeError(f"stage {w.name} did not step after a whole batch")

    step(0)
    before = [(w.stats.compute_cpu_s, w.stats.compute_s) for w in workers]
    t0 = time.thread_time()
    for i in range(steps):
        step(i + 1)
    total = time.thread_time() - t0
    samples = steps * batch
    per_stage = {w.name: round((w.stats.compute_cpu_s - c) / samples * 1000, 2) for w, (c, _) in zip(workers, before)}
    return {
        "manifest": Path(manifest).name, "overrides": list(overrides), "steps": steps, "samples": samples,
        "request_samples": micro, "threads": torch.get_num_threads(),
        "compute_cpu_ms_per_sample": round(sum(per_stage.values()), 2),
        "stage_compute_cpu_ms_per_sample": per_stage,
        "cpu_ms_per_sample": round(total / samples * 1000, 2),  # with the optimizer steps and the harness
        "steps_taken": [w.progress.step for w in workers],
        "batches": {w.name: {k: n for k, n in w.stats.batches.items() if n} for w in workers},
        "cache": {w.name: w.stats.cache for w in workers if w.cache is not None},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("manifest")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="Manifest override (repeatable).")
    ap.add_argument("--steps", type=int, default=4, help="Steps measured, after one warm-up step.")
    ap.add_argument("--json", action="store_true", help="Print one JSON object on stdout.")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    result = measure(args.manifest, args.sets, args.steps)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['manifest']}: worker compute {result['compute_cpu_ms_per_sample']} CPU ms per sample in one "
              f"process on one thread {result['stage_compute_cpu_ms_per_sample']}; with steps "
              f"{result['cpu_ms_per_sample']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
