"""`agoractl simulate` as a user runs it: real subprocesses, tiny settings, JSON on stdout, a PNG on
disk, the run's real shards when they exist, and one-line errors with exit codes 2 and 1. The module's
invocations run once, one after another in one interpreter (``cli_batch``: torch is imported once, not
once per invocation); each test checks its own."""

import json

import pytest

from tests.conftest import MANIFESTS, cli_batch

MANIFEST = str(MANIFESTS / "local-cpu.yaml")
TINY = ["--set", "model.d_model=32", "--set", "model.n_layers=2", "--set", "model.n_heads=2",
        "--set", "model.n_kv_heads=1", "--set", "model.d_ff=64", "--set", "model.seq_len=16",
        "--set", "model.ssn.rank=8", "--set", "stages=[{role: head, layers: 1}, {role: tail, layers: 1}]",
        "--set", "local.threads_per_process=1", "--set", "trainers.microbatch=1"]


BAD = [
    (["--scenario", "nope"], "error: Invalid value for '--scenario': 'nope' is not one of 'fgdiloco', "),
    (["--scenario", "sparta-participation", "--participation", "1.5"], "--participation"),
    (["--scenario", "fgdiloco", "--variants", "diloco,gossip"], "--variants: unknown gossip"),
    (["--scenario", "fgdiloco", "--replicas", "1"], "--replicas must be at least 2"),
    (["--scenario", "fgdiloco", "--plot", "missing/x.png"], "--plot: directory"),
    (["--scenario", "fgdiloco", "--step-time-s", "fast"], "--step-time-s"),
    (["--scenario", "fgdiloco", "--global-mixing", "ring"],
     "error: Invalid value for '--global-mixing': 'ring' is not one of 'butterfly', 'all-to-all'."),
]


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    """Every invocation of this module, run in one subprocess in a fresh directory: name -> CompletedProcess,
    and the directory under "dir"."""
    cwd = tmp_path_factory.mktemp("simulate")
    shards = ["--set", f"data.source={cwd}/sample/*.parquet", "--set", f"data.output={cwd}/shards",
              "--set", "data.num_shards=2", "--set", "trainers.count=1"]
    runs = {
        "fgdiloco": ["simulate", MANIFEST, "--scenario", "fgdiloco", *TINY, "--rounds", "2", "--inner-steps", "2",
                     "--replicas", "3", "--variants", "diloco,global_m1,local_m1_m2", "--json", "--plot", "fg.png"],
        "measured": ["simulate", MANIFEST, "--scenario", "fgdiloco", *TINY, "--rounds", "1", "--inner-steps", "2",
                     "--replicas", "2", "--variants", "global_m1", "--step-time-s", "measured", "--payload-params",
                     "model", "--bandwidth", "10", "--bandwidth", "1000", "--latency-ms", "0", "--global-mixing",
                     "butterfly", "--json"],
        "backward": ["simulate", MANIFEST, "--scenario", "sparta-backward", *TINY, "--set",
                     "training.global_batch_size=4", "--steps", "3", "--microbatch", "2", "--json", "--plot",
                     str(cwd / "b.png")],
        "participation": ["simulate", MANIFEST, "--scenario", "sparta-participation", *TINY,
                          "--set", "training.global_batch_size=4", "--participation", "1,0.5", "--warmup-steps", "1",
                          "--failure-steps", "2", "--recovery-steps", "1", "--microbatch", "2", "--json"],
        "human": ["simulate", MANIFEST, "--scenario", "fgdiloco", *TINY, "--rounds", "1", "--inner-steps", "1",
                  "--replicas", "2", "--variants", "diloco"],
        "sample": ["data", "sample", "--out", "sample", "--rows", "400", "--files", "2"],
        "shard": ["shard", MANIFEST, *shards],
        "shards": ["simulate", MANIFEST, "--scenario", "fgdiloco", *TINY, *shards, "--rounds", "1",
                   "--inner-steps", "2", "--replicas", "2", "--variants", "diloco", "--json"],
        **{f"bad{i}": ["simulate", MANIFEST, *args] for i, (args, _) in enumerate(BAD)},
        "no-index": ["simulate", MANIFEST, "--scenario", "fgdiloco", *TINY, "--set", f"data.output={cwd}/none",
                     "--data", "shards", "--rounds", "1", "--inner-steps", "1"],
    }
    return {**dict(zip(runs, cli_batch(runs.values(), cwd=cwd, timeout=900))), "dir": cwd}


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_fgdiloco_json_and_plot(sim):
    proc = ok(sim["fgdiloco"])
    out = json.loads(proc.stdout)
    assert out["scenario"] == "fgdiloco"
    assert out["data"].startswith("synthetic")
    assert set(out["variants"]) == {"diloco", "global_m1", "local_m1_m2"}
    for v in out["variants"].values():
        assert len(v["loss"]) == 4
        assert set(v["utilization"]) == {"100", "200"}
        assert {"final_loss", "js_mean", "js_max", "l2_mean"} <= set(v)
    a = out["assumptions"]
    assert a["payload_params"] == 1.5e9 and a["inner_steps_per_round"] == 100
    # The seed's regime: M = 8, gossip accounting, step time calibrated to its 29 vs 16 weeks at 200 Mbit/s.
    assert a["replicas"] == 8 and a["global_mixing"] == "all-to-all" and 20 < a["step_time_s"] < 21
    assert (sim["dir"] / "fg.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "simulate fgdiloco: diloco" in proc.stderr


def test_fgdiloco_measured_regime_and_bandwidths(sim):
    proc = ok(sim["measured"])
    out = json.loads(proc.stdout)
    a = out["assumptions"]
    assert a["payload_params"] == out["settings"]["model_params"]
    assert a["replicas"] == 2 and a["global_mixing"] == "butterfly"
    assert a["inner_steps_per_round"] == 2 and a["step_time_s"] > 0 and a["latency_ms"] == 0
    u = out["variants"]["global_m1"]["utilization"]
    assert set(u) == {"10", "1000"} and u["10"] <= u["1000"]


def test_sparta_scenarios_cli(sim):
    proc = ok(sim["backward"])
    out = json.loads(proc.stdout)
    assert set(out["variants"]) == {"pinned", "stochastic"}
    assert len(out["variants"]["pinned"]["loss"]) == 3
    assert (sim["dir"] / "b.png").stat().st_size > 0
    proc = ok(sim["participation"])
    out = json.loads(proc.stdout)
    assert set(out["variants"]) == {"p100", "p50"}
    assert out["settings"]["phases"]["failure"] == [1, 3]
    assert len(out["variants"]["p50"]["loss"]) == 4


def test_human_output(sim):
    proc = ok(sim["human"])
    assert "diloco" in proc.stdout and "util @100" in proc.stdout


def test_uses_the_runs_shards(sim):
    ok(sim["sample"]), ok(sim["shard"])
    out = json.loads(ok(sim["shards"]).stdout)
    assert out["data"] == f"shards:{sim['dir']}/shards"


def test_bad_input_is_one_line(sim):
    for i, (args, message) in enumerate(BAD):
        proc = sim[f"bad{i}"]
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    proc = sim["no-index"]
    assert proc.returncode == 1, proc.stderr
    assert "no shard index" in proc.stderr and "Traceback" not in proc.stderr
