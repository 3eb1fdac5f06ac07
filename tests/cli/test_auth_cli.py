"""``agoractl auth ...`` and ``agoractl launch authorizer`` as real subprocesses: key generation, the
service on PostgreSQL + Redis surviving SIGKILL with nothing lost, the live policy, the report and node
list in JSON, and one-line errors with the right exit codes."""

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
    out = json.loads(cli("auth", "keygen", "k/authority.key", "--json", check=0).stdout)
    assert len(out["public_key"]) == 43 and (tmp_path / "k/authority.key.pub").exists()
    r = cli("auth", "keygen", "k/authority.key", check=2)
    assert "already exists" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "manifest.yaml").write_text("metadata: {name: t}\n")
    r = cli("auth", "report", "manifest.yaml", check=2)
    assert "no Authorizer URL" in r.stderr
    r = cli("auth", "report", "manifest.yaml", "--authorizer", "http://127.0.0.1:9", check=2,
            env={"AGORA_AUTHORITY_KEY": ""})
    assert "AGORA_AUTHORITY_KEY is not set" in r.stderr
    r = cli("auth", "report", "manifest.yaml", "--authorizer", f"http://127.0.0.1:{free_port()}", check=1,
            env={"AGORA_AUTHORITY_KEY": str(tmp_path / "k/authority.key")})
    assert "is `agoractl launch authorizer` running there?" in r.stderr
    r = cli("launch", "authorizer", "manifest.yaml", check=2, env={"AGORA_AUTHORITY_KEY": str(tmp_path / "nope")})
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
        r = cli("auth", "ban", "manifest.yaml", "w9", "--authorizer", url, env=env, check=0)
        r = cli("auth", "policy", "set", "manifest.yaml", "max_contributors=1", "--authorizer", url, "--json",
                env=env, check=0)
        assert json.loads(r.stdout)["max_contributors"] == 1
        r = cli("auth", "policy", "set", "manifest.yaml", "max_contributors=-3", "--authorizer", url, env=env, check=2)
        assert "max_contributors" in r.stderr
        r = cli("auth", "policy", "set", "manifest.yaml", "contributor_stages=[nope]", "--authorizer", url, env=env,
                check=2)
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
            report = json.loads(cli("auth", "report", "manifest.yaml", "--authorizer", url, "--json", env=env,
                                    check=0).stdout)
            assert report["reasons"] == {"malformed": 1, "capacity": 1}
            human = cli("auth", "report", "manifest.yaml", "--authorizer", url, env=env, check=0).stdout
            assert "capacity" in human and "50.0%" in human
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    finally:
        backend.close()
