"""The shard ledger across real trainer processes with no shared directory (``agoractl launch trainer``
and ``launch swarm``): the ledger and the shards live on a loopback S3 API server (moto_server, serial:
atomic conditional writes as S3), and every trainer runs in its own working directory, with its own
node key and checkpoint store.

One swarm serves every check (module fixture): ``launch swarm`` with 2 stages x 1 worker and one trainer
of its own (ledger index 0, in the swarm's directory), ``data.epochs: 1``; beside it trainer A (index 1)
and trainer K (index 2) started by hand, each in its own directory. K is SIGKILLed after its second
settled sample, mid-shard. Trainers log each sample as it is settled (``trainers.record_sequences``),
so a killed trainer's record survives it. Checked from those logs, the trainers' stats and the claims in
the bucket: the two live trainers never read one shard, and with K every sequence of the epoch is read
once (K's in-flight ones at most twice); K's shard is continued after its lease expired from its first
uncompleted sequence; the swarm ends with end_reason naming the exhausted data and the step, exit 0.
Marked ``swarm``; every process is killed at the end, even on failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agoractl.data.claim_store import claim_store
from agoractl.data.claims import ledger_state
from agoractl.data.index import read_index
from agoractl.data.shard import reshard
from tests.conftest import MANIFESTS, s3_client_env
from tests.data.corpus import load_run, sample_corpus

pytestmark = pytest.mark.swarm
MANIFEST = MANIFESTS / "local-cpu.yaml"
SEQ, L1, SHARDS, LEASE_S, MAX_STEPS, K_IN_FLIGHT = 64, 65, 4, 4, 200, 2
SETS = ["model.seq_len=64", "stages=[{role: head, layers: 2}, {role: tail, layers: 2}]",
        "training.global_batch_size=8", "workers.max_microbatch=8", "training.schedule.warmup_steps=2",
        f"training.max_steps={MAX_STEPS}", "workers.announce_period_s=1", "trainers.discovery_period_s=2",
        "trainers.request_timeout_s=30", "network.startup_timeout_s=90", "trainers.microbatch=1",
        "data_parallel.method=none", f"data.num_shards={SHARDS}", "data.epochs=1", f"data.lease_s={LEASE_S}",
        "trainers.count=3", "trainers.shards_per_trainer=1", f"trainers.in_flight={K_IN_FLIGHT}",
        "trainers.record_sequences=true"]


def agoractl(*args: str) -> list[str]:
    return [sys.executable, "-m", "agoractl", *args]


def set_args(values) -> list[str]:
    return [a for v in values for a in ("--set", v)]


def settled(log: Path) -> list[tuple[tuple[int, int, int], bool]]:
    """((shard, epoch, offset), completed) per sample, from a trainer's JSON log lines, in order."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "sequences settled":
            out += [(tuple(s), bool(rec["completed"])) for s in rec["sequences"]]
    return out


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture(scope="module")
def claim_run(serial_s3_server, tmp_path_factory):
    """The whole run, once: returns what the checks read (see the module docstring)."""
    tmp = tmp_path_factory.mktemp("claim-swarm")
    s3 = s3_client_env(serial_s3_server)
    env = {**os.environ, **{k: v for k, v in s3.items() if k != "make_bucket"}, "PYTHONUNBUFFERED": "1"}
    env.pop("AGORA_DEBUG", None)
    # Trainers A and K start as new interpreters beside the swarm's own trainer Z: Z starts as one too (not forked
    # from the launcher, which starts it seconds earlier), or it may read the whole epoch before they claim a shard.
    env["AGORA_FORK_NODES"] = "0"
    out = s3["make_bucket"](f"claims-{uuid.uuid4().hex[:8]}") + "/run"
    src = sample_corpus(tmp / "corpus", rows=10, files=1, seed=3)
    with pytest.MonkeyPatch.context() as mp:  # this process writes the shards and reads the claims in the bucket
        for k, v in env.items():
            if k.startswith(("AGORA_S3", "AWS_")):
                mp.setenv(k, v)
        reshard(load_run(tmp, f"{src}/*.parquet", out, data__num_shards=SHARDS, model__seq_len=SEQ), jobs=1)
        result = run_all(tmp, env, out, read_index(out))
    (tmp / "result.json").write_text(json.dumps({k: v for k, v in result.items() if k != "index"}))  # to look at
    return result


def run_all(tmp: Path, env: dict, out: str, index) -> dict:
    values = [f"data.source={tmp / 'corpus'}/*.parquet", f"data.output={out}", *SETS]
    procs: list[subprocess.Popen] = []
    swarm_dir, status = tmp / "swarm", tmp / "swarm" / "swarm" / "status.json"
    swarm_dir.mkdir()
    err = swarm_dir / "console.err"
    try:
        swarm = subprocess.Popen(agoractl("launch", "swarm", str(MANIFEST), *set_args(values + [
            f"checkpoints.store={swarm_dir / 'store'}", f"local.run_dir={swarm_dir}", "local.workers_per_stage=1",
            "local.trainers=1"]), "--json"), cwd=swarm_dir, env=env, stdout=subprocess.PIPE,
            stderr=open(err, "wb"), start_new_session=True)
        procs.append(swarm)
        deadline = time.monotonic() + 180
        while not (m := re.search(r"DHT seed up in [\d.]+ s: (\S+)", err.read_text(errors="replace"))):
            assert swarm.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.2)
        peer = m.group(1)

        def trainer(name: str, index: int) -> tuple[subprocess.Popen, Path]:
            home = tmp / name  # its own working directory: no file shared with any other trainer
            home.mkdir()
            p = subprocess.Popen(agoractl("launch", "trainer", str(MANIFEST), *set_args(values + [
                f"checkpoints.store={home / 'store'}", f"local.run_dir={home}"]), "--index", str(index),
                "--initial-peers", peer, "--stats", str(home / "stats.json"), "--json"),
                cwd=home, env={**env, "AGORA_NODE_KEY": str(home / "node.key")}, stdout=subprocess.PIPE,
                stderr=open(home / "trainer.log", "wb"), start_new_session=True)
            procs.append(p)
            return p, home

        k, k_home = trainer("host-k", 2)
        a, a_home = trainer("host-a", 1)
        store, deadline = claim_store(out), time.monotonic() + 300
        while True:  # K's ledger record shows a completed start of its shard (10+ sequences): kill it
            assert k.poll() is None and swarm.poll() is None and time.monotonic() < deadline, \
                (k_home / "trainer.log").read_text(errors="replace")[-3000:]
            if (done := [q for q, ok in settled(k_home / "trainer.log") if ok]) and \
                    json.loads(store.read(f"claims/epoch-00000/shard-{done[0][0]:05d}.json")[0])["consumed"]:
                break
            time.sleep(0.05)
        kill_group(k.pid)
        k.wait(10)
        k_settled = settled(k_home / "trainer.log")
        (k_shard,) = {s for (s, _, _), _ in k_settled}  # one shard, not read to its end
        at_kill = json.loads(store.read(f"claims/epoch-00000/shard-{k_shard:05d}.json")[0])
        swarm_out, _ = swarm.communicate(timeout=420)
        a_out, _ = a.communicate(timeout=60)
        console = err.read_text(errors="replace")
        assert swarm.returncode == 0, f"swarm exit {swarm.returncode}:\n{console[-3000:]}"
        assert a.returncode == 0, f"trainer A exit {a.returncode}:\n{(a_home / 'trainer.log').read_text()[-3000:]}"
        return {"index": index, "report": json.loads(swarm_out), "console": console, "a": json.loads(a_out),
                "a_stats": json.loads((a_home / "stats.json").read_text()),
                "z": settled(swarm_dir / "swarm" / "logs" / "trainer-0.log"),
                "a_settled": settled(a_home / "trainer.log"), "k": k_settled, "k_shard": k_shard, "at_kill": at_kill,
                "ledger": ledger_state(store, SHARDS, 1),
                "claims": {s: json.loads(store.read(f"claims/epoch-00000/shard-{s:05d}.json")[0])
                           for s in range(SHARDS)}}
    finally:
        pids = [p.pid for p in procs]
        try:
            pids += [n["pid"] for n in json.loads(status.read_text())["nodes"]]
        except (OSError, ValueError, KeyError):
            pass
        for pid in pids:
            kill_group(pid)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


def all_sequences(index) -> set[tuple[int, int, int]]:
    return {(k, 0, i * L1) for k, s in enumerate(index.shards) for i in range(s.tokens // L1)}


def test_two_trainers_without_a_shared_directory_claim_every_shard_once(claim_run):
    """The swarm's trainer (Z) and trainer A, sharing only the ledger in the bucket: every shard claimed by
    exactly one of them (K's aside, taken over by one of them), no shard read by both, every sequence of
    the epoch read once — with K's, only K's in-flight ones read again."""
    r = claim_run
    z, a, k = ({s for s, _ in r[key]} for key in ("z", "a_settled", "k"))
    for key in ("z", "a_settled"):
        assert len(r[key]) == len({s for s, _ in r[key]}), key  # nobody reads a sequence twice
    z_shards, a_shards = {s for s, _, _ in z}, {s for s, _, _ in a}
    assert z_shards and a_shards and not z_shards & a_shards  # both read, never one shard
    assert z | a | k == all_sequences(r["index"])  # none skipped
    assert not z & a and len((z | a) & k) <= K_IN_FLIGHT  # once; K's unflushed ones at most again
    (epoch,) = r["ledger"]["epochs"]
    assert epoch["claimed"] == epoch["done"] == SHARDS
    for s, c in r["claims"].items():  # each shard claimed once, by the one that read it; K's taken over once
        assert c["done"] and len(c["history"]) == (s == r["k_shard"]), c
        assert s in (z_shards if c["trainer"] == 0 else a_shards if c["trainer"] == 1 else set()), (s, c["trainer"])
    assert r["a"]["end_reason"] == "data exhausted after 1 epoch(s)"  # launch trainer --json, exit 0
    done_a = {tuple(q) for q, ok in r["a_settled"] if ok}
    assert {tuple(q[:3]) for q in r["a_stats"]["sequences"]} == done_a and r["a_stats"]["lost"] == len(a) - len(done_a)


def test_a_sigkilled_trainers_shard_is_continued_from_its_first_uncompleted_sequence(claim_run):
    """K killed mid-shard: its claim is taken over only after its lease expired, by one trainer, which
    reads on from the first sequence K had not completed, skipping what K completed beyond it; of what K
    completed, at most its in-flight count is read again."""
    r = claim_run
    shard, at_kill, after = r["k_shard"], r["at_kill"], r["claims"][r["k_shard"]]
    offsets = [i * L1 for i in range(r["index"].shards[shard].tokens // L1)]
    k_done = {o for (_, _, o), _ in r["k"]}
    assert at_kill["trainer"] == 2 and not at_kill["done"] and 0 < at_kill["consumed"] < offsets[-1]  # mid-shard
    assert set(o for o in offsets if o < at_kill["consumed"]) | set(at_kill["skip"]) <= k_done  # the ledger = K's record
    (took,) = after["history"]
    assert took["trainer"] == 2 and took["consumed"] == at_kill["consumed"]
    assert took["time"] >= at_kill["lease_until"]  # not before K's lease ran out
    heir = "z" if after["trainer"] == 0 else "a_settled"
    read = [o for (s, _, o), _ in r[heir] if s == shard]
    assert min(read) == at_kill["consumed"]  # continued at K's first uncompleted sequence ...
    assert sorted(read) == [o for o in offsets if o >= at_kill["consumed"] and o not in at_kill["skip"]]
    assert len(set(read) & k_done) <= K_IN_FLIGHT  # ... completed by K but not yet written: at most in flight
    assert min(o for o in offsets if o not in k_done) >= at_kill["consumed"]


def test_the_swarm_ends_when_its_one_epoch_is_read(claim_run):
    """data.epochs 1: the run ends before max_steps, exit 0 (checked by the fixture), and says why —
    the data's epoch read and the step reached — in the report and on the console."""
    r = claim_run["report"]
    steps = r["steps"]
    assert not r["completed"] and 0 < steps < MAX_STEPS
    assert r["end_reason"] == f"data exhausted after 1 epoch(s) at step {steps} of {MAX_STEPS}", r["end_reason"]
    assert f"swarm ended: {r['end_reason']} (exit code 0)" in claim_run["console"]
