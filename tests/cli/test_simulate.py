"""`agoractl simulate` as a user runs it: real subprocesses, tiny settings, JSON on stdout, a PNG on
disk, the run's real shards when they exist, and one-line errors with exit codes 2 and 1."""

import json

from tests.conftest import MANIFESTS

MANIFEST = str(MANIFESTS / "local-cpu.yaml")
TINY = ["--set", "model.d_model=32", "--set", "model.n_layers=2", "--set", "model.n_heads=2",
        "--set", "model.n_kv_heads=1", "--set", "model.d_ff=64", "--set", "model.seq_len=16",
        "--set", "model.ssn.rank=8", "--set", "stages=[{role: head, layers: 1}, {role: tail, layers: 1}]",
        "--set", "local.threads_per_process=1"]


def test_fgdiloco_json_and_plot(cli, tmp_path):
    proc = cli("simulate", MANIFEST, "--scenario", "fgdiloco", *TINY, "--rounds", "2", "--inner-steps", "2",
               "--replicas", "3", "--variants", "diloco,global_m1,local_m1_m2", "--json", "--plot", "fg.png",
               check=0)
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
    assert (tmp_path / "fg.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "simulate fgdiloco: diloco" in proc.stderr


def test_fgdiloco_measured_regime_and_bandwidths(cli):
    proc = cli("simulate", MANIFEST, "--scenario", "fgdiloco", *TINY, "--rounds", "1", "--inner-steps", "2",
               "--replicas", "2", "--variants", "global_m1", "--step-time-s", "measured", "--payload-params",
               "model", "--bandwidth", "10", "--bandwidth", "1000", "--latency-ms", "0", "--global-mixing", "butterfly",
               "--json", check=0)
    out = json.loads(proc.stdout)
    a = out["assumptions"]
    assert a["payload_params"] == out["settings"]["model_params"]
    assert a["replicas"] == 2 and a["global_mixing"] == "butterfly"
    assert a["inner_steps_per_round"] == 2 and a["step_time_s"] > 0 and a["latency_ms"] == 0
    u = out["variants"]["global_m1"]["utilization"]
    assert set(u) == {"10", "1000"} and u["10"] <= u["1000"]


def test_sparta_scenarios_cli(cli, tmp_path):
    proc = cli("simulate", MANIFEST, "--scenario", "sparta-backward", *TINY, "--set", "training.global_batch_size=4",
               "--steps", "3", "--microbatch", "2", "--json", "--plot", str(tmp_path / "b.png"), check=0)
    out = json.loads(proc.stdout)
    assert set(out["variants"]) == {"pinned", "stochastic"}
    assert len(out["variants"]["pinned"]["loss"]) == 3
    assert (tmp_path / "b.png").stat().st_size > 0
    proc = cli("simulate", MANIFEST, "--scenario", "sparta-participation", *TINY,
               "--set", "training.global_batch_size=4", "--participation", "1,0.5", "--warmup-steps", "1",
               "--failure-steps", "2", "--recovery-steps", "1", "--microbatch", "2", "--json", check=0)
    out = json.loads(proc.stdout)
    assert set(out["variants"]) == {"p100", "p50"}
    assert out["settings"]["phases"]["failure"] == [1, 3]
    assert len(out["variants"]["p50"]["loss"]) == 4


def test_human_output(cli):
    proc = cli("simulate", MANIFEST, "--scenario", "fgdiloco", *TINY, "--rounds", "1", "--inner-steps", "1",
               "--replicas", "2", "--variants", "diloco", check=0)
    assert "diloco" in proc.stdout and "util @100" in proc.stdout


def test_uses_the_runs_shards(cli, tmp_path):
    cli("data", "sample", "--out", "sample", "--rows", "400", "--files", "2", check=0)
    sets = ["--set", f"data.source={tmp_path}/sample/*.parquet", "--set", f"data.output={tmp_path}/shards",
            "--set", "data.num_shards=2", "--set", "trainers.count=1"]
    cli("shard", MANIFEST, *sets, check=0)
    proc = cli("simulate", MANIFEST, "--scenario", "fgdiloco", *TINY, *sets, "--rounds", "1", "--inner-steps", "2",
               "--replicas", "2", "--variants", "diloco", "--json", check=0)
    out = json.loads(proc.stdout)
    assert out["data"] == f"shards:{tmp_path}/shards"


def test_bad_input_is_one_line(cli, tmp_path):
    cases = [
        (["--scenario", "nope"], "error: Invalid value for '--scenario': 'nope' is not one of 'fgdiloco', "),
        (["--scenario", "sparta-participation", "--participation", "1.5"], "--participation"),
        (["--scenario", "fgdiloco", "--variants", "diloco,gossip"], "--variants: unknown gossip"),
        (["--scenario", "fgdiloco", "--replicas", "1"], "--replicas must be at least 2"),
        (["--scenario", "fgdiloco", "--plot", str(tmp_path / "missing" / "x.png")], "--plot: directory"),
        (["--scenario", "fgdiloco", "--step-time-s", "fast"], "--step-time-s"),
        (["--scenario", "fgdiloco", "--global-mixing", "ring"],
         "error: Invalid value for '--global-mixing': 'ring' is not one of 'butterfly', 'all-to-all'."),
    ]
    for args, message in cases:
        proc = cli("simulate", MANIFEST, *args, check=2)
        assert message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    proc = cli("simulate", MANIFEST, "--scenario", "fgdiloco", *TINY, "--set", f"data.output={tmp_path}/none",
               "--data", "shards", "--rounds", "1", "--inner-steps", "1", check=1)
    assert "no shard index" in proc.stderr and "Traceback" not in proc.stderr
