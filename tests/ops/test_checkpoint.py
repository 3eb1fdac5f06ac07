"""Tests of the checkpoint store (agoractl.ops.checkpoint) on local files and on a real loopback S3
API server (moto_server) through s3fs: round trips of model and AdamW state, LATEST written last
(a publisher killed with SIGKILL leaves the previous checkpoint as LATEST), keep_last retention,
replica snapshots, and one-line errors for a missing bucket, bad credentials and no endpoint.
Real processes, no mocks; the tiny local-cpu model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from agoractl.errors import RuntimeFailure
from agoractl.manifest.loader import load_manifest
from agoractl.ops import optimizer_state
from agoractl.ops.checkpoint import CheckpointStore, due
from agoractl.model.build import build_stage
from tests.conftest import MANIFESTS, ROOT

torch.set_num_threads(1)


def _run():
    return load_manifest(MANIFESTS / "local-cpu.yaml")


def _trained_head(steps: int = 2):
    """The head stage and its AdamW after a few real steps (so the optimizer has moments)."""
    run = _run()
    stage = build_stage(run, 0)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3, betas=(0.9, 0.95))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        stage(None, tokens).pow(2).mean().backward()
        opt.step()
    return run, stage, opt


def _assert_same_state(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_optimizer_state_roundtrip_restores_adamw():
    _, stage, opt = _trained_head()
    tensors = {}
    tree = optimizer_state.encode(opt.state_dict(), tensors)
    restored = optimizer_state.decode(tree, tensors)
    fresh = torch.optim.AdamW(build_stage(_run(), 0).parameters(), lr=1e-3)
    fresh.load_state_dict(restored)
    a, b = opt.state_dict(), fresh.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i in a["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][i][key], b["state"][i][key])


@pytest.fixture(params=["local", "s3"])
def store_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    s3_env = request.getfixturevalue("s3_env")
    return s3_env["make_bucket"](f"ckpt-{os.getpid()}-{time.monotonic_ns() % 10**9}") + "/run"


def test_publish_load_list_and_retention(store_url):
    run, stage, opt = _trained_head()
    store = CheckpointStore(store_url, keep_last=2)
    assert store.latest_step("head") is None
    for step in (10, 20, 30):
        store.publish("head", step, stage.state_dict(), opt.state_dict(), {"peer": "p1"})
    assert store.latest_step("head") == 30
    assert store.steps("head") == [20, 30]  # keep_last=2 deleted step 10
    ck = store.load("head")
    assert ck.meta["step"] == 30 and ck.meta["stage"] == "head" and ck.meta["peer"] == "p1"
    assert set(ck.meta["files"]) == {"model.safetensors", "optimizer.safetensors", "optimizer.json"}
    _assert_same_state(ck.model_state, stage.state_dict())
    loaded = build_stage(run, 0)
    joined_opt = torch.optim.AdamW(loaded.parameters())
    assert ck.apply_to(loaded, joined_opt) == 30  # a joining worker starting from the store
    _assert_same_state(loaded.state_dict(), stage.state_dict())
    assert torch.equal(joined_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(RuntimeFailure, match="does not fit this stage"):
        ck.apply_to(build_stage(run, 2))
    assert store.load("head", 20).meta["step"] == 20
    rows = store.list()
    assert [(r["stage"], r["step"], r["latest"]) for r in rows] == [("head", 20, False), ("head", 30, True)]
    # An older step published late neither moves LATEST back nor survives retention.
    store.publish("head", 5, stage.state_dict(), None, {})
    assert store.latest_step("head") == 30 and store.steps("head") == [20, 30]


def test_run_store_records_manifest_hash_and_kept_step(tmp_path):
    from agoractl.manifest.loader import manifest_hash

    run = load_manifest(MANIFESTS / "local-cpu.yaml", [f"checkpoints.store={tmp_path}/s", "checkpoints.keep_last=1"])
    store = CheckpointStore(run)
    assert store.keep_last == 1
    state = build_stage(run, 2).state_dict()
    store.publish("tail", 50, state, None, {})
    assert store.load("tail").meta["manifest_hash"] == manifest_hash(run)
    changed = {k: v + 1 for k, v in state.items()}
    store.publish("tail", 50, changed, None, {})  # another replica publishing the same step: first one kept
    _assert_same_state(store.load("tail").model_state, state)
    store.publish("tail", 50, changed, None, {}, overwrite=True)
    _assert_same_state(store.load("tail").model_state, changed)
    assert due(50, 50) and not due(49, 50) and not due(50, 0) and not due(0, 50)


def test_damaged_checkpoint_is_refused(tmp_path):
    store = CheckpointStore(str(tmp_path / "s"))
    store.publish("head", 1, {"w": torch.ones(4)}, None, {})
    path = tmp_path / "s" / "checkpoints" / "head" / "step-00000001" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(RuntimeFailure, match="does not match its meta.json"):
        store.load("head")


KILLED_PUBLISHER = textwrap.dedent("""
    import sys, time, torch
    torch.set_num_threads(1)
    from agoractl.ops.checkpoint import CheckpointStore
    url, stop_at, flag = sys.argv[1:4]
    store = CheckpointStore(url, keep_last=2)
    write = store._write
    def hooked(u, data):
        if u.endswith("/" + stop_at):
            open(flag, "w").write("ready")
            time.sleep(600)  # SIGKILLed here by the test, before this object is written
        write(u, data)
    store._write = hooked
    store.publish("head", 20, {"w": torch.full((1000,), 2.0)}, None, {})
""")


@pytest.mark.parametrize("stop_at", ["LATEST", "meta.json"])
def test_publish_killed_before_latest_keeps_previous(s3_env, tmp_path, stop_at):
    url = s3_env["make_bucket"](f"killed-{stop_at.lower().replace('.', '-')}") + "/run"
    store = CheckpointStore(url, keep_last=2)
    store.publish("head", 10, {"w": torch.full((1000,), 1.0)}, None, {})
    flag = tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PUBLISHER, url, stop_at, str(flag)], cwd=ROOT,
                            env=os.environ.copy())
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert proc.poll() is None, "the publisher exited before reaching the kill point"
            assert time.monotonic() < deadline, "the publisher never reached the kill point"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert store.latest_step("head") == 10
    assert torch.equal(store.load("head").model_state["w"], torch.full((1000,), 1.0))
    # Killed before meta.json: step 20 is not a checkpoint; killed after it: complete but not LATEST.
    assert store.steps("head") == ([10, 20] if stop_at == "LATEST" else [10])
    # The next publish moves LATEST and clears what the killed publisher left behind.
    store.publish("head", 30, {"w": torch.full((1000,), 3.0)}, None, {})
    assert store.latest_step("head") == 30
    expected = ["step-00000020", "step-00000030"] if stop_at == "LATEST" else ["step-00000010", "step-00000030"]
    assert store._ls("checkpoints", "head") == ["LATEST", *expected]


def test_snapshots_roundtrip_and_ranged_reads(store_url):
    store = CheckpointStore(store_url)
    states = {f"peer-{i}": {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16)} for i in range(3)}
    for replica, state in states.items():
        store.save_snapshot("body-1", 40, replica, state, meta={"last_averaged_segment": 3})
    store.save_snapshot("body-1", 20, "peer-0", states["peer-0"])
    assert store.snapshot_stages() == ["body-1"]
    assert store.snapshot_steps("body-1") == [20, 40]
    assert store.snapshot_replicas("body-1", 40) == ["peer-0", "peer-1", "peer-2"]
    seen = dict(store.iter_snapshot("body-1", 40))
    for replica, state in states.items():
        _assert_same_state(seen[replica], state)
    with store.open_snapshot("body-1", 40, "peer-1") as f:
        assert f.metadata["last_averaged_segment"] == "3" and f.metadata["replica"] == "peer-1"
        assert torch.equal(f.read("a", 4, 11), states["peer-1"]["a"].reshape(-1)[4:11])
        assert torch.equal(f.read("b"), states["peer-1"]["b"])
    with pytest.raises(Exception, match="replica name"):
        store.save_snapshot("body-1", 40, "../escape", states["peer-0"])


def test_missing_bucket_is_one_clear_line(s3_env):
    store = CheckpointStore("s3://no-such-bucket-anywhere/run")
    for call in (lambda: store.list(), lambda: store.publish("head", 1, {"w": torch.ones(2)}, None, {}),
                 lambda: store.load("head")):
        with pytest.raises(RuntimeFailure) as e:
            call()
        assert e.value.message == "s3://no-such-bucket-anywhere/run: the bucket does not exist"


def test_unreachable_endpoint_is_one_clear_line(monkeypatch, tmp_path):
    from tests.conftest import _free_port

    monkeypatch.setenv("AGORA_S3_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries would only slow the test
    with pytest.raises(RuntimeFailure) as e:
        CheckpointStore("s3://bucket/run").latest_step("head")
    assert e.value.message.startswith("s3://bucket/run: cannot reach the store")
    assert "\n" not in e.value.message
