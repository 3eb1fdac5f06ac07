"""`agoractl launch dht|worker|trainer|swarm`: bad input gives one line naming the problem and the fix,
with exit code 2 (usage) or 1 (runtime). Real invocations, one after another in one subprocess
(``cli_batch``); the swarm itself is tested in tests/runtime/test_swarm.py."""

from __future__ import annotations

import pytest

from agoractl.runtime.node import BOOTSTRAP_ATTEMPTS
from tests.conftest import MANIFESTS, cli_batch

MANIFEST = str(MANIFESTS / "local-cpu.yaml")


def one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


UNREACHABLE = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWA8vgwVz2TDUV5wNfkRU2rLt6E5Phgkn2fMnbTvZ8w81b"


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The module's invocations, one after another in one interpreter (``cli_batch``): name ->
    CompletedProcess; their directory under "dir"."""
    d = tmp_path_factory.mktemp("launch-nodes")
    runs = {
        "stage-nope": ["launch", "worker", MANIFEST, "--stage", "nope"],
        "no-dht": ["launch", "worker", MANIFEST, "--stage", "head"],
        "unreachable": ["launch", "worker", MANIFEST, "--stage", "auto", "--initial-peers", UNREACHABLE],
        "trainer-index": ["launch", "trainer", MANIFEST, "--index", "7", "--initial-peers", "/ip4/127.0.0.1/tcp/1"],
        "swarm-no-data": ["launch", "swarm", MANIFEST, "--set", f"data.output={d}/none", "--set",
                          f"local.run_dir={d}/run"],
        "swarm-trainers": ["launch", "swarm", MANIFEST, "--set", "local.trainers=3", "--set", "trainers.count=2"],
        "swarm-device": ["launch", "swarm", MANIFEST, "--device", "gpu"],
        "swarm-cuda": ["launch", "swarm", MANIFEST, "--device", "cuda", "--set", f"local.run_dir={d}/run-cuda"],
        "swarm-microbatch": ["launch", "swarm", MANIFEST, "--set", "trainers.microbatch=32"],
    }
    return {**dict(zip(runs, cli_batch(runs.values(), cwd=d))), "dir": d}


def exits(proc, code: int):
    assert proc.returncode == code, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_worker_rejects_an_unknown_stage_and_a_missing_dht(launches):
    proc = exits(launches["stage-nope"], 2)
    assert "--stage nope" in one_error_line(proc.stderr) and "head, body-1, tail" in proc.stderr
    proc = exits(launches["no-dht"], 2)
    assert "--initial-peers" in one_error_line(proc.stderr) and "agoractl launch dht" in proc.stderr


def test_worker_reports_an_unreachable_dht_in_one_line(launches):
    proc = exits(launches["unreachable"], 1)
    assert "DHT" in one_error_line(proc.stderr) and "hint:" in proc.stderr
    # Before giving up, the DHT node was started again (a busy seed may turn the first dials away).
    again = [line for line in proc.stderr.splitlines() if "starting the DHT node again" in line]
    assert len(again) == BOOTSTRAP_ATTEMPTS - 1, proc.stderr


def test_trainer_index_must_be_in_the_ledger(launches):
    proc = exits(launches["trainer-index"], 2)
    assert "trainers.count" in one_error_line(proc.stderr)


def test_swarm_checks_the_data_before_starting_anything(launches):
    tmp_path = launches["dir"]
    proc = exits(launches["swarm-no-data"], 1)
    assert "index.json" in one_error_line(proc.stderr) and "agoractl shard" in proc.stderr
    assert not (tmp_path / "run" / "swarm" / "logs").exists() or not any((tmp_path / "run" / "swarm" / "logs").iterdir())
    proc = exits(launches["swarm-trainers"], 2)
    assert "local.trainers" in one_error_line(proc.stderr)


def test_swarm_checks_the_device_and_the_request_size_before_starting_anything(launches):
    proc = exits(launches["swarm-device"], 2)
    assert "--device gpu" in one_error_line(proc.stderr) and "cuda:N" in proc.stderr
    proc = exits(launches["swarm-cuda"], 2)  # this machine has no CUDA: no worker is started to find out
    assert "CUDA is not available" in one_error_line(proc.stderr) and "--device cpu" in proc.stderr
    assert not (launches["dir"] / "run-cuda" / "swarm" / "logs").exists()
    proc = exits(launches["swarm-microbatch"], 2)  # a request larger than a step's batch would overshoot it
    assert "trainers.microbatch: must be at most a step's batch (16 samples)" in proc.stderr and "got 32" in proc.stderr


def _report(stage_extra: dict) -> dict:
    stage = {"name": "head", "workers_seen": 2, "steps": 4, "samples": 32, "max_coalesced": 2, "retries": 0,
             "bans": 0, "backward_fallbacks": 0, **stage_extra}
    return {"name": "t", "steps": 4, "tokens": 1024, "elapsed_s": 2.0, "tokens_per_s": 512.0, "loss": [[0, 5.5]],
            "final_loss": 5.0, "samples_lost": 0, "stages": [stage], "report_path": "r.json"}


def test_swarm_summary_shows_averaging_health(capsys):
    """The console summary of launch swarm shows SPARTA's rounds and success, or FGDiLoCo's outer rounds and
    mix success, per stage (REVIEW: the report JSON had them, the console did not)."""
    from agoractl.cli.launch_nodes import _render_swarm

    _render_swarm(_report({"averaging_rounds": 3, "averaging_success_mean": 0.875, "rounds_failed": 1}))
    out = capsys.readouterr().out
    assert "avg rounds" in out and "avg success" in out and "88%" in out and "failed rounds" in out
    _render_swarm(_report({"outer_rounds": 2, "mix1_success_mean": 1.0, "mix2_success_mean": None}))
    out = capsys.readouterr().out
    assert "outer rounds" in out and "mix1 success" in out and "100%" in out and "avg rounds" not in out
