"""Tests of ``agoractl checkpoint publish|fetch|list`` as real subprocesses against a bucket on a
loopback moto_server (through s3fs), and their one-line errors: missing bucket, bad credentials
(a second moto_server that enforces authentication), unknown stage, wrong files. Each test's invocations
run one after another in one interpreter (``cli.batch``)."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from agoractl.manifest.loader import load_manifest
from agoractl.ops import optimizer_state
from agoractl.model.build import build_stage
from tests.conftest import MANIFESTS, moto_server

torch.set_num_threads(1)
FILE = MANIFESTS / "local-cpu.yaml"


def _write_dir(path, index=0, step=None):
    """A checkpoint directory as a user would have it: a stage's state and its trained AdamW."""
    stage = build_stage(load_manifest(FILE), index)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    out = stage(None, torch.zeros(1, 8, dtype=torch.long)) if index == 0 else None
    if out is not None:
        out.pow(2).mean().backward()
        opt.step()
    path.mkdir(parents=True)
    safetensors.torch.save_file(stage.state_dict(), str(path / "model.safetensors"))
    tensors = {}
    tree = optimizer_state.encode(opt.state_dict(), tensors)
    safetensors.torch.save_file(tensors, str(path / "optimizer.safetensors"))
    (path / "optimizer.json").write_text(json.dumps(tree))
    if step is not None:
        (path / "meta.json").write_text(json.dumps({"step": step, "stage": "head"}))
    return stage.state_dict()


def exits(proc, code: int):
    assert proc.returncode == code, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_publish_fetch_list_on_s3(cli, s3_env, tmp_path):
    store = s3_env["make_bucket"]("cli-ckpt") + "/runs/a"
    sets = ["--set", f"checkpoints.store={store}", "--set", "checkpoints.keep_last=1"]
    state = _write_dir(tmp_path / "src", step=100)
    r, r300, listing, r_fetch, republish, human = cli.batch(
        ["checkpoint", "publish", FILE, "--stage", "head", "--from", tmp_path / "src", *sets, "--json"],
        ["checkpoint", "publish", FILE, "--stage", "head", "--from", tmp_path / "src", "--step", 300, *sets],
        ["checkpoint", "list", FILE, *sets, "--json"],
        ["checkpoint", "fetch", FILE, "--stage", "head", "--to", tmp_path / "out", *sets, "--json"],
        # What fetch writes, publish reads: republish the fetched directory under the step in its meta.json.
        ["checkpoint", "publish", FILE, "--stage", "head", "--from", tmp_path / "out", *sets, "--json"],
        ["checkpoint", "list", FILE, *sets])
    pub = json.loads(exits(r, 0).stdout)
    assert pub == {"stage": "head", "step": 100, "url": f"{store}/checkpoints/head/step-00000100", "latest": 100,
                   "skipped": False, "optimizer": True}
    exits(r300, 0)
    listing = json.loads(exits(listing, 0).stdout)
    assert [(c["stage"], c["step"], c["latest"]) for c in listing["checkpoints"]] == [("head", 300, True)]
    assert listing["store"] == store and listing["snapshots"] == {}
    fetched = json.loads(exits(r_fetch, 0).stdout)
    assert fetched["step"] == 300 and fetched["files"] == ["meta.json", "model.safetensors", "optimizer.json",
                                                           "optimizer.safetensors"]
    got = safetensors.torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["step"] == 300 and meta["stage"] == "head" and len(meta["manifest_hash"]) == 16
    assert json.loads(exits(republish, 0).stdout)["skipped"] is True
    human = exits(human, 0).stdout
    assert "LATEST" in human and "300" in human


def test_bad_input_is_exit_2(cli, tmp_path):
    sets = ["--set", f"checkpoints.store={tmp_path / 'store'}"]
    _write_dir(tmp_path / "src")
    (tmp_path / "empty").mkdir()
    stage, other, step, fetch = cli.batch(
        ["checkpoint", "publish", FILE, "--stage", "nope", "--from", tmp_path / "src", "--step", 1, *sets],
        ["checkpoint", "publish", FILE, "--stage", "tail", "--from", tmp_path / "src", "--step", 1, *sets],
        ["checkpoint", "publish", FILE, "--stage", "head", "--from", tmp_path / "empty", *sets],
        ["checkpoint", "fetch", FILE, "--stage", "head", "--to", tmp_path / "o", *sets])
    r = exits(stage, 2)
    assert "--stage nope: no such stage; stages are head, body-1, tail" in r.stderr
    r = exits(other, 2)
    assert "not a checkpoint of stage tail" in r.stderr
    r = exits(step, 2)
    assert "--step: required" in r.stderr
    r = exits(fetch, 1)
    assert "no published checkpoint of stage head" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_bucket_is_one_line_exit_1(cli, s3_env):
    r = cli("checkpoint", "list", FILE, "--set", "checkpoints.store=s3://no-such-bucket/run", check=1)
    assert r.stderr.splitlines()[0] == "error: s3://no-such-bucket/run: the bucket does not exist"
    assert r.stdout == "" and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def s3_auth_server():
    """A second moto_server that checks credentials (INITIAL_NO_AUTH_ACTION_COUNT=0): unknown keys fail."""
    with moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as endpoint:
        yield endpoint


def test_bad_credentials_are_one_line_exit_1(cli, s3_auth_server, tmp_path):
    env = {"AGORA_S3_ENDPOINT_URL": s3_auth_server, "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG",
           "AWS_SECRET_ACCESS_KEY": "wrong", "AWS_DEFAULT_REGION": "us-east-1"}
    _write_dir(tmp_path / "src")
    for r in cli.batch(*([*args, "--set", "checkpoints.store=s3://some-bucket/run"] for args in (
            ["checkpoint", "list", FILE], ["checkpoint", "publish", FILE, "--stage", "head", "--from", tmp_path / "src",
                                           "--step", 1])), env=env):
        exits(r, 1)
        assert r.stderr.splitlines()[0] == ("error: s3://some-bucket/run: access denied: check AWS_ACCESS_KEY_ID / "
                                            "AWS_SECRET_ACCESS_KEY")
        assert "Traceback" not in r.stderr
