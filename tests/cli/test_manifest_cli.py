"""End-to-end tests of `agoractl manifest ...` and the error conventions, through real subprocesses."""

import json

from tests.conftest import MANIFESTS
from tests.manifest.test_loader import THREE_MISTAKES


def test_validate_all_shipped(cli):
    cli("manifest", "validate", *sorted(MANIFESTS.glob("*.yaml")), check=0)


def test_three_mistakes_exit_2_one_line_each_no_traceback(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(THREE_MISTAKES)
    proc = cli("manifest", "validate", bad, check=2)
    err = proc.stderr
    assert "Traceback" not in err
    assert f"{bad}:8: trainig: unknown key; did you mean 'training'?" in err
    assert f"{bad}:12: data_parallel.sparta.fraction:" in err
    assert f"{bad}:5: stages: stage layers sum to 3" in err


def test_validate_json(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(THREE_MISTAKES)
    proc = cli("manifest", "validate", "--json", bad, MANIFESTS / "local-cpu.yaml", check=2)
    doc = json.loads(proc.stdout)
    assert doc["valid"] is False
    assert [f["valid"] for f in doc["files"]] == [False, True]
    assert len(doc["files"][0]["problems"]) == 3


def test_plan_json_keys(cli):
    proc = cli("manifest", "plan", MANIFESTS / "ablation-1b.yaml", "--json", check=0)
    p = json.loads(proc.stdout)
    for s in p["stages"]:
        assert {"name", "role", "layers", "params", "dense_params", "memory_bytes"} <= set(s)
    assert {"dense", "compressed"} <= set(p["boundary_bytes_per_token"])
    assert {"bf16", "fp32"} <= set(p["required_bandwidth_mbps"])
    assert "sparta_bytes_per_round" in p


def test_plan_human_and_set(cli):
    proc = cli("manifest", "plan", MANIFESTS / "local-cpu.yaml", "--set", "model.ssn.rank=8", check=0)
    assert "body-1" in proc.stdout and "8.0x" in proc.stdout


def test_schema_is_json(cli):
    doc = json.loads(cli("manifest", "schema", check=0).stdout)
    assert doc["title"] == "Run"


def test_usage_errors_exit_2(cli, tmp_path):
    assert cli("manifest", "plan").returncode == 2
    assert cli("manifest", "plan", MANIFESTS / "local-cpu.yaml", "--bogus").returncode == 2
    proc = cli("manifest", "plan", tmp_path / "missing.yaml", check=2)
    assert "no such manifest file" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("manifest", "plan", MANIFESTS / "local-cpu.yaml", "--ar-params", "x", check=2)


def test_debug_shows_traceback(cli, tmp_path):
    proc = cli("manifest", "plan", tmp_path / "missing.yaml", env={"AGORA_DEBUG": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_empty_and_binary_manifests_one_line_exit_2(cli, tmp_path):
    empty, binary = tmp_path / "empty.yaml", tmp_path / "model.safetensors"
    empty.write_text("")
    binary.write_bytes(bytes(range(256)) * 4)
    for command in ("validate", "plan"):
        err = cli("manifest", command, empty, check=2).stderr
        assert err.splitlines()[0] == f"error: {empty}: the manifest is empty: apiVersion and kind are missing"
        err = cli("manifest", command, binary, check=2).stderr
        assert err.splitlines()[0].startswith(f"error: {binary}: not UTF-8 YAML (")
        assert "this is a bug" not in err and "Traceback" not in err and len(err.splitlines()) == 2


def test_plan_shows_tiny_bandwidth_with_precision(cli):
    # local-cpu needs ~0.4 Mbit/s per node: the table and summary once rounded that to "0".
    doc = json.loads(cli("manifest", "plan", MANIFESTS / "local-cpu.yaml", "--json", check=0).stdout)
    bw = doc["required_bandwidth_mbps"]
    assert 0.1 < bw["bf16"] < 1
    out = cli("manifest", "plan", MANIFESTS / "local-cpu.yaml", check=0).stdout
    assert f"{bw['bf16']:.3g} Mbit/s with a bf16 all-reduce, {bw['fp32']:.3g} Mbit/s with fp32" in out
    big = cli("manifest", "plan", MANIFESTS / "pluralis-8b.yaml", check=0).stdout
    assert "113 Mbit/s with a bf16 all-reduce, 186 Mbit/s with fp32" in big
