"""The monitoring stack of ``launch swarm`` with ``monitoring.enabled``: Debian's Prometheus push gateway and
Prometheus server as subprocesses on loopback, and the Prometheus configuration that scrapes the swarm (its
nodes register as file_sd targets in ``<run_dir>/monitoring/targets``; the push gateway is scraped with
``honor_labels`` so pushed series keep their labels) and loads the shipped alert rules."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

from agoractl.errors import RuntimeFailure
from agoractl.runtime.metrics import PUSH_TOKEN_ENV
from agoractl.services.health import RULES

PACKAGES = {"prometheus": "prometheus", "prometheus-pushgateway": "prometheus-pushgateway",
            "promtool": "prometheus"}


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeFailure(f"{name} not found (monitoring.enabled needs it)",
                             hint=f"apt-get install -y {PACKAGES.get(name, name)} (or `make system-packages`)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeFailure(f"{what} exited at start (code {proc.returncode})", hint=f"see its log under {url}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeFailure(f"{what} did not answer {url} within {timeout_s:.0f} s")


def prometheus_config(targets_dir: Path, pushgateway: Optional[str], interval_s: float, rules: Path) -> dict:
    jobs = [{"job_name": "agora", "honor_labels": True,
             "file_sd_configs": [{"files": [str(targets_dir / "*.json")], "refresh_interval": f"{interval_s:g}s"}]}]
    if pushgateway:
        jobs.append({"job_name": "agora-push", "honor_labels": True,
                     "static_configs": [{"targets": [pushgateway.split("://", 1)[-1].rstrip("/")]}]})
    return {"global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s"},
            "rule_files": [str(rules)], "scrape_configs": jobs}


@dataclass
class Stack:
    """Running push gateway and Prometheus (``stop`` ends both). They stay in the caller's process group, so a
    launcher killed as a group (SIGKILL to ``launch swarm``'s group) takes them along."""

    root: Path
    procs: list = field(default_factory=list)
    pushgateway_url: str = ""
    prometheus_url: str = ""
    targets_dir: Path = Path()

    def start_pushgateway(self, port: int = 0) -> str:
        port = port or free_port()
        # Its own persistence file: Debian's default (/var/lib/prometheus/pushgateway.data) is shared by every
        # gateway on the machine.
        self.pushgateway_url = self._serve("prometheus-pushgateway", port,
                                           f"--persistence.file={self.root / 'pushgateway.data'}")
        return self.pushgateway_url

    def start_prometheus(self, interval_s: float, port: int = 0, rules: Path = RULES) -> str:
        port = port or free_port()
        self.targets_dir = self.root / "targets"
        self.targets_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(rules, self.root / "alerts.rules.yml")
        config = prometheus_config(self.targets_dir, self.pushgateway_url or None, interval_s,
                                   self.root / "alerts.rules.yml")
        (self.root / "prometheus.yml").write_text(json.dumps(config, indent=2))  # JSON is YAML
        self.prometheus_url = self._serve("prometheus", port, f"--config.file={self.root / 'prometheus.yml'}",
                                          f"--storage.tsdb.path={self.root / 'tsdb'}")
        return self.prometheus_url

    def _serve(self, name: str, port: int, *args: str) -> str:
        """Start Debian's NAME on 127.0.0.1:PORT (log under the stack's root) and wait until it is ready; its URL."""
        log = open(self.root / f"{name.removeprefix('prometheus-')}.log", "ab")
        proc = subprocess.Popen([binary(name), f"--web.listen-address=127.0.0.1:{port}", *args],
                                stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/-/ready", proc, name)
        return url

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def for_swarm(run, set_, note):
    """For `launch swarm` with monitoring.enabled: a push gateway behind the push gate, and a Prometheus server
    scraping the swarm's nodes (each serves /metrics and registers in <run_dir>/monitoring/targets) with the
    shipped alert rules. Returns (stack, overrides for the nodes); prints the URLs. The swarm starts the Health
    Monitor itself (a utility node)."""
    from agoractl.services.authorizer.server import Background  # uvicorn, fastapi
    from agoractl.services.health import push_gate
    from agoractl.services.health.db import database_url

    root = Path(run.local.run_dir).resolve() / "monitoring"
    shutil.rmtree(root / "targets", ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    stack = Stack(root)
    try:
        gateway = stack.start_pushgateway()
        os.environ.setdefault(PUSH_TOKEN_ENV, secrets.token_urlsafe(24))  # the nodes inherit it
        gate = Background(push_gate.create_app(run, gateway, run.admission.authority_public_key))
        stack.procs.append(_Stoppable(gate))
        prometheus = stack.start_prometheus(run.monitoring.scrape_interval_s)
    except BaseException:
        stack.stop()
        raise
    note(f"monitoring: Prometheus {prometheus} (alerts {prometheus}/api/v1/alerts), push gateway {gateway} "
         f"(contributors push through {gate.url} with a bearer token), health database {database_url(run)}; "
         f"`agoractl status FILE` summarizes it")
    return stack, [*(set_ or []), "monitoring.metrics_port=0", f"monitoring.targets_dir={stack.targets_dir}"]


class _Stoppable:
    """The push gate (a uvicorn thread) as one of the stack's processes."""

    def __init__(self, server) -> None:
        self.server, self.returncode = server, None

    def poll(self):
        return self.returncode

    def terminate(self) -> None:
        self.server.stop()
        self.returncode = 0

    def wait(self, timeout=None) -> int:
        return 0

    def kill(self) -> None:
        pass
