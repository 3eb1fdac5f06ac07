"""``agoractl auth ...`` and ``agoractl launch authorizer`` as real subprocesses: key generation, the
service on PostgreSQL + Redis surviving SIGKILL with nothing lost, the live policy, the report and node
list in JSON, and one-line errors with the right exit codes. Invocations that follow one another with
nothing between them share one interpreter (``cli.batch``); the service is a process of its own."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from tests.services.conftest import Backend


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_authorizer(tmp_path, env, port):
    proc = subprocess.Popen([sys.executable, "-m", "agoractl", "launch", "authorizer", "manifest.yaml",
                             "--port", str(port)], cwd=tmp_path, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/ping", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read())
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("the Authorizer did not answer")


def test_keygen_and_errors(cli, tmp_path):
    (tmp_path / "manifest.yaml").write_text("metadata: {name: t}\n")
    at = lambda args, **env: (args, tmp_path, env)  # noqa: E731 - an invocation with its own variables
    keygen, again, no_url, no_key, no_service, no_file = cli.batch(
        ["auth", "keygen", "k/authority.key", "--json"],
        ["auth", "keygen", "k/authority.key"],
        ["auth", "report", "manifest.yaml"],
        at(["auth", "report", "manifest.yaml", "--authorizer", "http://127.0.0.1:9"], AGORA_AUTHORITY_KEY=""),
        at(["auth", "report", "manifest.yaml", "--authorizer", f"http://127.0.0.1:{free_port()}"],
           AGORA_AUTHORITY_KEY=str(tmp_path / "k/authority.key")),
        at(["launch", "authorizer", "manifest.yaml"], AGORA_AUTHORITY_KEY=str(tmp_path / "nope")))
    assert [p.returncode for p in (keygen, again, no_url, no_key, no_service, no_file)] == [0, 2, 2, 2, 1, 2], \
        [p.stderr for p in (keygen, again, no_url, no_key, no_service, no_file)]
    out = json.loads(keygen.stdout)
    assert len(out["public_key"]) == 43 and (tmp_path / "k/authority.key.pub").exists()
    r = again
    assert "already exists" in r.stderr and "Traceback" not in r.stderr
    r = no_url
    assert "no Authorizer URL" in r.stderr
    r = no_key
    assert "AGORA_AUTHORITY_KEY is not set" in r.stderr
    r = no_service
    assert "is `agoractl launch authorizer` running there?" in r.stderr
    r = no_file
    assert "no such file" in r.stderr


def test_service_survives_sigkill_and_the_cli_operates_it(cli, tmp_path):
    backend = Backend("postgres+redis", tmp_path)
    try:
        key = tmp_path / "authority.key"
        cli("auth", "keygen", str(key), check=0)
        (tmp_path / "manifest.yaml").write_text(
            "metadata: {name: t}\nadmission: {enabled: true, min_vram_gb: 0, min_ram_gb: 0, "
            "min_bandwidth_mbps: 0, joins_per_minute: 6000}\n")
        env = {"AGORA_AUTHORITY_KEY": str(key), "AGORA_DATABASE_URL": backend.settings.database_url,
               "AGORA_REDIS_URL": backend.settings.redis_url, "AGORA_REDIS_PREFIX": backend.settings.redis_prefix}
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_authorizer(tmp_path, env, port)
        admitted = httpx.post(url + "/v1/join", json={"node_id": "w1", "role": "worker", "peer_id": "12D3KooWA",
                                                      "ready": True}).json()
        assert admitted["status"] == "admitted"
        httpx.post(url + "/v1/join", json={"node_id": "w2", "role": "worker", "peer_id": "12D3KooWB"})
        httpx.post(url + "/v1/join", json={"node_id": "bad", "role": "boss", "peer_id": "12D3KooWC"})
        ban, policy, negative, stage = cli.batch(
            ["auth", "ban", "manifest.yaml", "w9", "--authorizer", url],
            ["auth", "policy", "set", "manifest.yaml", "max_contributors=1", "--authorizer", url, "--json"],
            ["auth", "policy", "set", "manifest.yaml", "max_contributors=-3", "--authorizer", url],
            ["auth", "policy", "set", "manifest.yaml", "contributor_stages=[nope]", "--authorizer", url], env=env)
        assert [p.returncode for p in (ban, policy, negative, stage)] == [0, 0, 2, 2], \
            [p.stderr for p in (ban, policy, negative, stage)]
        r = policy
        assert json.loads(r.stdout)["max_contributors"] == 1
        r = negative
        assert "max_contributors" in r.stderr
        r = stage
        assert "no stage nope" in r.stderr
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc = start_authorizer(tmp_path, env, port)
        try:
            nodes = json.loads(cli("auth", "nodes", "manifest.yaml", "--authorizer", url, "--json", env=env,
                                   check=0).stdout)
            assert {(n["node_id"], n["status"], n["role"]) for n in nodes} == {
                ("w1", "admitted", "worker"), ("w2", "queued", "worker")}
            assert set(nodes[0]) >= {"node_id", "peer_id", "role", "stage", "status"}
            assert httpx.get(url + "/v1/bans").json()["bans"] == ["w9"]
            renewed = httpx.post(url + "/v1/renew", json={"credential": admitted["credential"], "peer_id": "12D3KooWA"})
            assert renewed.json()["status"] == "admitted"
            held = httpx.post(url + "/v1/join", json={"node_id": "w2", "role": "worker", "peer_id": "12D3KooWB",
                                                      "ready": True}).json()
            assert held["reason"] == "capacity"  # the live policy (max_contributors=1) survived too
            report, human = cli.batch(["auth", "report", "manifest.yaml", "--authorizer", url, "--json"],
                                      ["auth", "report", "manifest.yaml", "--authorizer", url], env=env)
            assert (report.returncode, human.returncode) == (0, 0), (report.stderr, human.stderr)
            report = json.loads(report.stdout)
            assert report["reasons"] == {"malformed": 1, "capacity": 1}
            human = human.stdout
            assert "capacity" in human and "50.0%" in human
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    finally:
        backend.close()
