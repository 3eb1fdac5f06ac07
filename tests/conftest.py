"""Shared pytest fixtures: the repository root, shipped manifests, and running the real CLI.

The suite runs on two pytest-xdist workers (``-n 2 --dist loadgroup``, pyproject.toml): tests marked
``swarm`` (real multi-process swarms) all go to one of them, one at a time, so that two swarms never
starve each other of the machine's two cores; every other test runs on the other worker beside them.
A ``swarm`` module with light processes (no trainers) may name its own ``xdist_group`` to run beside them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("swarm") is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group("swarm"))


@pytest.fixture
def cli(tmp_path):
    """Run `python -m agoractl ARGS` in tmp_path as a real subprocess; returns CompletedProcess.
    ``cli.batch(ARGS, ARGS, ...)``: several invocations in one subprocess (:func:`cli_batch`)."""

    def run(*args, cwd=None, env=None, timeout=300, check=None):
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env.pop("AGORA_DEBUG", None) if not (env and "AGORA_DEBUG" in env) else None
        proc = subprocess.run([sys.executable, "-m", "agoractl", *map(str, args)], cwd=cwd or tmp_path,
                              env=full_env, capture_output=True, text=True, timeout=timeout)
        if check is not None:
            assert proc.returncode == check, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        return proc

    def batch(*invocations, cwd=None, env=None, timeout=300):
        return cli_batch(invocations, cwd=cwd or tmp_path, env=env, timeout=timeout)

    run.batch = batch
    return run


_BATCH = r"""
import json, os, sys, tempfile, traceback
from agoractl.cli.main import run
invocations, result_path, results = json.loads(sys.argv[1]), sys.argv[2], []
for argv, cwd, env in invocations:
    os.chdir(cwd)
    environ = dict(os.environ)
    os.environ.update(env)
    sys.stdout.flush(); sys.stderr.flush()
    saved, files = [os.dup(1), os.dup(2)], [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    os.dup2(files[0].fileno(), 1); os.dup2(files[1].fileno(), 2)
    sys.argv = ["agoractl", *argv]
    try:
        run()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        os.environ.clear(); os.environ.update(environ)
    out = []
    for f in files:
        f.seek(0)
        out.append(f.read().decode(errors="replace"))
    results.append({"returncode": code, "stdout": out[0], "stderr": out[1]})
with open(result_path, "w") as f:
    json.dump(results, f)
"""


def cli_batch(invocations, cwd, env=None, timeout=300) -> list[subprocess.CompletedProcess]:
    """Run several `agoractl ARGS` invocations, one after another, through the real entry point
    (:func:`agoractl.cli.main.run`, which turns every error into one line and an exit code) in ONE fresh
    subprocess: the interpreter starts, and torch is imported, once instead of once per invocation. Each
    invocation's file descriptors 1 and 2 are captured on their own (so are logs and anything a child
    writes); returns one CompletedProcess per invocation, its returncode the code `run` exits with. An
    invocation is a list of arguments, run in `cwd`, or a tuple (arguments, its own working directory[, the
    variables it adds to `env`: for settings agoractl reads when a command runs, not at import]). For
    bad-input checks; a test whose subject is the process itself (signals, crashes) spawns it alone."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("AGORA_DEBUG", None) if not (env and "AGORA_DEBUG" in env) else None
    invocations = [(*i, {})[:3] if isinstance(i, tuple) else (i, cwd, {}) for i in invocations]
    spec = [([str(a) for a in args], str(where), own) for args, where, own in invocations]
    with tempfile.TemporaryDirectory(prefix="cli-batch-") as tmp:
        result = Path(tmp) / "result.json"
        proc = subprocess.run([sys.executable, "-c", _BATCH, json.dumps(spec), str(result)],
                              cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0 and result.is_file(), f"batch exit {proc.returncode}\n{proc.stderr}"
        got = json.loads(result.read_text())
    return [subprocess.CompletedProcess([sys.executable, "-m", "agoractl", *a], r["returncode"], r["stdout"],
                                        r["stderr"]) for (a, _, _), r in zip(spec, got)]


@pytest.fixture(scope="session")
def sample_shards(tmp_path_factory) -> Path:
    """The sample corpus (2,000 rows in 2 files) and its 4 shards, made once per test session (per xdist
    worker) with the real commands, in one interpreter (:func:`cli_batch`): returns the directory holding
    sample/ and shards/. Tests that run a swarm copy the shards (:func:`private_shards`): trainers write a
    ledger and progress beside them."""
    root = tmp_path_factory.mktemp("sample-shards")
    for proc in cli_batch([["data", "sample", "--out", root / "sample", "--rows", "2000", "--files", "2", "--json"],
                           ["shard", MANIFESTS / "local-cpu.yaml", "--set", f"data.source={root / 'sample'}/*.parquet",
                            "--set", f"data.output={root / 'shards'}", "--set", "data.num_shards=4", "--json"]],
                          cwd=root):
        assert proc.returncode == 0, f"{proc.args}: exit {proc.returncode}\n{proc.stderr}"
    return root


def private_shards(sample_shards: Path, dest: Path) -> list[str]:
    """A copy of the session's shards in `dest`/shards (no ledger: the run makes its own, sized by its
    trainers.count); returns the --set values that point a run at it."""
    shutil.copytree(sample_shards / "shards", dest / "shards", ignore=shutil.ignore_patterns("ledger.json", "progress"))
    return [f"data.source={sample_shards / 'sample'}/*.parquet", f"data.output={dest / 'shards'}", "data.num_shards=4"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERIAL_MOTO = ("import sys, moto.server as m; run = m.run_simple; "
               "m.run_simple = lambda *a, **k: run(*a, **{**k, 'threaded': False}); m.main(sys.argv[1:])")
"""moto_server handling one request at a time. moto checks a conditional PutObject's precondition and
stores the object in two steps, unlocked, so its threaded server can let two ``If-None-Match: *`` PUTs
of one key both succeed (seen with moto 5.2.1: 2 winners of 50 in 1 of 20 trials); S3 itself decides
conditional writes atomically. Tests of the shard ledger's claims run it serially, as S3 behaves."""


@contextlib.contextmanager
def moto_server(env: dict | None = None, serial: bool = False):
    """A real S3 API server (moto_server, the one installed beside this Python) on a free loopback port,
    stopped on exit; yields its endpoint URL. `env` adds environment variables (e.g. to enforce auth);
    `serial`: one request at a time (atomic conditional writes, see :data:`SERIAL_MOTO`)."""
    exe = Path(sys.executable).parent / "moto_server"
    exe = str(exe) if exe.exists() else shutil.which("moto_server")
    port = _free_port()
    argv = [sys.executable, "-c", SERIAL_MOTO] if serial else [exe]
    proc = subprocess.Popen([*argv, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=2)
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def s3_server():
    """The session's loopback S3 server; tests get its endpoint and test credentials through `s3_env`."""
    with moto_server() as endpoint:
        yield endpoint


def s3_client_env(endpoint: str) -> dict:
    """The environment that points agoractl (and boto3) at a loopback S3 server with test credentials, and
    a `make_bucket(name)` helper (returns ``s3://name``) under key 'make_bucket'."""
    import boto3

    env = {"AGORA_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def make_bucket(name: str) -> str:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=name)
        return f"s3://{name}"

    return {**env, "make_bucket": make_bucket}


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Point this process (and subprocesses given os.environ) at the loopback S3 server.

    Returns a dict of the variables set, and a `make_bucket(name)` helper under key 'make_bucket'.
    """
    env = s3_client_env(s3_server)
    for k, v in env.items():
        if k != "make_bucket":
            monkeypatch.setenv(k, v)
    return env


@pytest.fixture(scope="session")
def serial_s3_server():
    """A loopback S3 server answering one request at a time (atomic conditional writes, as S3)."""
    with moto_server(serial=True) as endpoint:
        yield endpoint


@pytest.fixture
def serial_s3_env(serial_s3_server, monkeypatch):
    """Like `s3_env`, against :func:`serial_s3_server`; returns the environment and 'make_bucket'."""
    env = s3_client_env(serial_s3_server)
    for k, v in env.items():
        if k != "make_bucket":
            monkeypatch.setenv(k, v)
    return env
