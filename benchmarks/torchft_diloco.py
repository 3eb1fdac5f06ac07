"""torchft's DiLoCo (torchft 0.2.0, ``torchft.local_sgd.DiLoCo``) on a manifest's whole model: the field's
reference that ``fgdiloco_vs_torchft.py`` compares agoractl's FGDiLoCo with.

One run is this script's ``run`` command: its process hosts torchft's lighthouse (on loopback, ``min_replicas``
= the replica groups) and starts one process per replica group (``replica``), each with one torch
thread, its own TCPStore, a gloo process group (``ProcessGroupGloo``) and a torchft ``Manager`` (synchronous
quorum, ``init_sync=False``: every replica builds the same initial weights from the manifest's seed). Each
replica group trains the model that ``launch central`` builds (:class:`agoractl.training.central.Central`:
the model, AdamW, the cosine schedule, the clipping) on its share of every global batch: batch ``b`` of the
run's data stream (:func:`agoractl.data.stream.run_sequences`, what ``launch central`` reads) gives replica
``r`` the consecutive block ``b[r * share:(r + 1) * share]`` (share = the batch / the groups): the split of
``agoractl simulate`` and of a swarm's replicas on their own counts (:mod:`agoractl.algorithms.routing`).
DiLoCo syncs every ``data_parallel.fgdiloco.inner_steps`` steps with the outer optimizer ``torch.optim.SGD`` at
the manifest's outer lr, momentum and Nesterov flag.

The replicas read their samples before they join the lighthouse (so data reading is start-up, not
training), and time each step. ``run`` prints one JSON report on stdout with the run report's keys
(``steps``, ``tokens``, ``elapsed_s``, ``tokens_per_s``, ``loss`` per global step = the mean of the replicas'
losses over their equal shares, ``final_loss``) and ``started_at`` (wall time of the first step's start).

    pip install -e '.[bench]'     # torchft==0.2.0
    python benchmarks/torchft_diloco.py run manifests/fgdiloco-dp-cpu.yaml --set data.output=/tmp/x/shards
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def replica(a: argparse.Namespace) -> None:
    """One replica group: train `steps` inner steps under torchft's DiLoCo; write its timings and losses."""
    import torch

    torch.set_num_threads(1)
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from agoractl.data.stream import run_sequences
    from agoractl.manifest.loader import load_manifest
    from agoractl.training.central import Central, batches

    run = load_manifest(a.manifest, a.sets)
    t, fg = run.training, run.data_parallel.fgdiloco
    share = t.global_batch_size // a.groups
    # Central at the replica's share of the batch: its loss is the mean over the share, its micro-batches fit.
    central = Central(load_manifest(a.manifest, [*a.sets, f"training.global_batch_size={share}"]))
    data = list(itertools.islice(batches(run_sequences(run), t.global_batch_size), t.max_steps))
    if len(data) < t.max_steps:
        raise SystemExit(f"the data stream has {len(data)} global batches; the run needs {t.max_steps}")
    model, inner = central.model, central.optimizer
    outer = torch.optim.SGD(model.parameters(), lr=fg.outer_lr, momentum=fg.outer_momentum, nesterov=fg.nesterov)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=a.timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=a.groups, use_async_quorum=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=f"replica_{a.rank}", store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=a.lighthouse, hostname="127.0.0.1", init_sync=False,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
    losses, starts, ends = [], [], []
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=fg.inner_steps, backup_device=torch.device("cpu"),
                    pin_memory=False):
            for batch in data:
                starts.append(time.time())
                loss, _, _ = central.step(batch[a.rank * share:(a.rank + 1) * share])  # inner AdamW; every H-th syncs
                ends.append(time.time())
                losses.append(loss)
        commits = manager.current_step()
    finally:
        manager.shutdown(wait=False)
    Path(a.out).write_text(json.dumps({"rank": a.rank, "loss": losses, "starts": starts, "ends": ends,
                                       "outer_commits": commits, "share": share}))


def run(a: argparse.Namespace) -> dict:
    """Lighthouse + one process per replica group; the merged report (see the module docstring)."""
    from torchft._torchft import LighthouseServer

    from agoractl.manifest.loader import load_manifest
    from agoractl.training.report import run_report

    r = load_manifest(a.manifest, a.sets)
    if r.training.global_batch_size % a.groups:
        raise SystemExit(f"training.global_batch_size {r.training.global_batch_size} does not split into "
                         f"{a.groups} replica groups")
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=a.groups)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"  # it advertises the host name
    with tempfile.TemporaryDirectory(prefix="torchft-diloco-") as tmp:
        outs = [Path(tmp) / f"replica-{i}.json" for i in range(a.groups)]
        procs = [subprocess.Popen([sys.executable, __file__, "replica", str(a.manifest), *[x for s in a.sets for x in
                                   ("--set", s)], "--rank", str(i), "--groups", str(a.groups), "--lighthouse",
                                   address, "--out", str(out), "--timeout-s", str(a.timeout_s)], cwd=ROOT)
                 for i, out in enumerate(outs)]
        codes = [p.wait() for p in procs]
        lighthouse.shutdown()
        if any(codes):
            raise SystemExit(f"torchft replica groups exited with {codes}")
        reps = [json.loads(o.read_text()) for o in outs]
    steps = min(len(x["loss"]) for x in reps)
    start = min(x["starts"][0] for x in reps)
    elapsed = max(x["ends"][steps - 1] for x in reps) - start
    loss = [[s, sum(x["loss"][s] for x in reps) / len(reps)] for s in range(steps)]
    return run_report(mode="torchft", name=r.metadata.name, steps=steps,
                      tokens=steps * r.training.global_batch_size * r.model.seq_len, elapsed_s=elapsed, loss=loss,
                      started_at=start, global_batch_size=r.training.global_batch_size, seq_len=r.model.seq_len,
                      replica_groups=a.groups, inner_steps=r.data_parallel.fgdiloco.inner_steps,
                      outer_commits=[x["outer_commits"] for x in reps],
                      replica_final_loss=[sum(x["loss"][-5:]) / len(x["loss"][-5:]) for x in reps])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("run", "replica"), help="run: the whole run; replica: one group (internal)")
    p.add_argument("manifest", type=Path)
    p.add_argument("--set", dest="sets", action="append", default=[], help="dotted.path=value (repeatable)")
    p.add_argument("--groups", type=int, default=2, help="replica groups (processes), each 1 torch thread")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="torchft's quorum, collective and connect timeouts, in seconds")
    p.add_argument("--rank", type=int, default=0, help="replica: this group's index")
    p.add_argument("--lighthouse", help="replica: the lighthouse's address")
    p.add_argument("--out", help="replica: where to write its result")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.command == "replica":
        replica(a)
    else:
        print(json.dumps(run(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
