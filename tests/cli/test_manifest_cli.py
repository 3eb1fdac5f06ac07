"""End-to-end tests of `agoractl manifest ...` and the error conventions, through real subprocesses. The
module's invocations run once, one after another in one interpreter (``cli_batch``); each test checks its
own. AGORA_DEBUG's traceback is a process's own (a process of its own)."""

import json

import pytest

from tests.conftest import MANIFESTS, cli_batch
from tests.manifest.test_loader import THREE_MISTAKES

LOCAL = MANIFESTS / "local-cpu.yaml"


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    """Every invocation below, by name -> CompletedProcess; the files they read are in m["dir"]."""
    d = tmp_path_factory.mktemp("manifest-cli")
    (d / "bad.yaml").write_text(THREE_MISTAKES)
    (d / "empty.yaml").write_text("")
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    runs = {
        "validate-shipped": ["manifest", "validate", *sorted(MANIFESTS.glob("*.yaml"))],
        "three-mistakes": ["manifest", "validate", d / "bad.yaml"],
        "validate-json": ["manifest", "validate", "--json", d / "bad.yaml", LOCAL],
        "plan-json-1b": ["manifest", "plan", MANIFESTS / "ablation-1b.yaml", "--json"],
        "plan-set": ["manifest", "plan", LOCAL, "--set", "model.ssn.rank=8"],
        "schema": ["manifest", "schema"],
        "plan-no-file": ["manifest", "plan"],
        "plan-bogus": ["manifest", "plan", LOCAL, "--bogus"],
        "plan-missing": ["manifest", "plan", d / "missing.yaml"],
        "plan-ar-params": ["manifest", "plan", LOCAL, "--ar-params", "x"],
        **{f"{command}-{kind}": ["manifest", command, d / name] for command in ("validate", "plan")
           for kind, name in (("empty", "empty.yaml"), ("binary", "model.safetensors"))},
        "plan-json": ["manifest", "plan", LOCAL, "--json"],
        "plan": ["manifest", "plan", LOCAL],
        "plan-8b": ["manifest", "plan", MANIFESTS / "pluralis-8b.yaml"],
    }
    return {**dict(zip(runs, cli_batch(runs.values(), cwd=d))), "dir": d}


def exits(proc, code: int):
    assert proc.returncode == code, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_validate_all_shipped(m):
    exits(m["validate-shipped"], 0)


def test_three_mistakes_exit_2_one_line_each_no_traceback(m):
    bad = m["dir"] / "bad.yaml"
    proc = exits(m["three-mistakes"], 2)
    err = proc.stderr
    assert "Traceback" not in err
    assert f"{bad}:8: trainig: unknown key; did you mean 'training'?" in err
    assert f"{bad}:12: data_parallel.sparta.fraction:" in err
    assert f"{bad}:5: stages: stage layers sum to 3" in err


def test_validate_json(m):
    proc = exits(m["validate-json"], 2)
    doc = json.loads(proc.stdout)
    assert doc["valid"] is False
    assert [f["valid"] for f in doc["files"]] == [False, True]
    assert len(doc["files"][0]["problems"]) == 3


def test_plan_json_keys(m):
    proc = exits(m["plan-json-1b"], 0)
    p = json.loads(proc.stdout)
    for s in p["stages"]:
        assert {"name", "role", "layers", "params", "dense_params", "memory_bytes"} <= set(s)
    assert {"dense", "compressed"} <= set(p["boundary_bytes_per_token"])
    assert {"bf16", "fp32"} <= set(p["required_bandwidth_mbps"])
    assert "sparta_bytes_per_round" in p


def test_plan_human_and_set(m):
    proc = exits(m["plan-set"], 0)
    assert "body-1" in proc.stdout and "8.0x" in proc.stdout


def test_schema_is_json(m):
    doc = json.loads(exits(m["schema"], 0).stdout)
    assert doc["title"] == "Run"


def test_usage_errors_exit_2(m):
    assert m["plan-no-file"].returncode == 2
    assert m["plan-bogus"].returncode == 2
    proc = exits(m["plan-missing"], 2)
    assert "no such manifest file" in proc.stderr and "Traceback" not in proc.stderr
    exits(m["plan-ar-params"], 2)


def test_debug_shows_traceback(cli, tmp_path):
    proc = cli("manifest", "plan", tmp_path / "missing.yaml", env={"AGORA_DEBUG": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_empty_and_binary_manifests_one_line_exit_2(m):
    empty, binary = m["dir"] / "empty.yaml", m["dir"] / "model.safetensors"
    for command in ("validate", "plan"):
        err = exits(m[f"{command}-empty"], 2).stderr
        assert err.splitlines()[0] == f"error: {empty}: the manifest is empty: apiVersion and kind are missing"
        err = exits(m[f"{command}-binary"], 2).stderr
        assert err.splitlines()[0].startswith(f"error: {binary}: not UTF-8 YAML (")
        assert "this is a bug" not in err and "Traceback" not in err and len(err.splitlines()) == 2


def test_plan_shows_tiny_bandwidth_with_precision(m):
    # local-cpu needs ~0.4 Mbit/s per node: the table and summary once rounded that to "0".
    doc = json.loads(exits(m["plan-json"], 0).stdout)
    bw = doc["required_bandwidth_mbps"]
    assert 0.1 < bw["bf16"] < 1
    out = exits(m["plan"], 0).stdout
    assert f"{bw['bf16']:.3g} Mbit/s with a bf16 all-reduce, {bw['fp32']:.3g} Mbit/s with fp32" in out
    big = exits(m["plan-8b"], 0).stdout
    assert "113 Mbit/s with a bf16 all-reduce, 186 Mbit/s with fp32" in big
