"""Prometheus metrics of every node (report §3.6.3), with ``prometheus-client``.

Each node builds a :class:`NodeMetrics` over its own counters (read at scrape or push time, so the compute
loop pays nothing per sample) plus what its structured events tell (averaging rounds, optimizer steps, sync
phases). Every series carries the labels ``run``, ``role`` (worker, trainer), ``stage`` (empty for trainers)
and ``instance`` (16 hex digits of the node key's hash: :func:`agoractl.auth.node_key.instance_id`, stable
across restarts when the key is kept, as ``launch swarm`` does). Names and meanings: :data:`METRICS` and the
table in docs/metrics.md (a test keeps the two equal).

Exposure: operators serve ``/metrics`` (``monitoring.metrics_port``; with ``monitoring.targets_dir`` they also
register themselves there as a Prometheus file_sd target); contributors push to a push gateway
(``monitoring.push_gateway``) every ``monitoring.push_interval_s`` with ``Authorization: Bearer`` (the
Authorizer's credential when admission is on, else ``$AGORA_PUSH_TOKEN``).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Callable, Optional

import psutil
from prometheus_client import CollectorRegistry, push_to_gateway, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import default_handler

from agoractl import logs, storage
from agoractl.manifest.schema import Run

LABELS = ("run", "role", "stage", "instance")
PUSH_TOKEN_ENV = "AGORA_PUSH_TOKEN"

METRICS: dict[str, tuple[str, str, str]] = {
    # name: (type, who exports it, meaning)
    "agora_data_await_seconds_total": ("counter", "worker", "Seconds the compute loop waited for a request (data await)."),
    "agora_compute_seconds_total": ("counter", "worker", "Seconds spent computing forward and backward passes."),
    "agora_coalesced_batch_size": ("gauge", "worker", "Mean samples per compute pass (coalesced requests)."),
    "agora_coalesced_batch_size_max": ("gauge", "worker", "Largest coalesced compute pass so far."),
    "agora_samples_total": ("counter", "worker, trainer",
                            "Samples processed: a worker's backward passes; a trainer's completed samples."),
    "agora_tokens_total": ("counter", "worker, trainer", "Tokens processed (samples x model.seq_len)."),
    "agora_ram_bytes": ("gauge", "worker, trainer", "Resident memory of the node and its DHT and p2pd processes."),
    "agora_host_memory_available_ratio": ("gauge", "worker, trainer", "Share of the host's memory still available."),
    "agora_gpu_memory_bytes": ("gauge", "worker", "GPU memory allocated by torch (only on CUDA)."),
    "agora_gpu_memory_total_bytes": ("gauge", "worker", "GPU memory of the device (only on CUDA)."),
    "agora_sent_bytes_total": ("counter", "worker", "Bytes this node sent in data-parallel averaging."),
    "agora_received_bytes_total": ("counter", "worker", "Bytes this node received in data-parallel averaging."),
    "agora_grad_norm": ("gauge", "worker", "Gradient norm of the stage before clipping, at its last optimizer step."),
    "agora_step": ("gauge", "worker, trainer", "The stage's optimizer step (trainers: the tail's, as last seen)."),
    "agora_loss": ("gauge", "trainer", "Mean loss of the samples a trainer completed since its previous report."),
    "agora_rounds_total": ("counter", "worker", "Averaging rounds by outcome (label status: complete, partial, "
                                                "failed, empty, skipped)."),
    "agora_reduce_success_ratio": ("gauge", "worker", "Reduce success of the last round this reducer took part in."),
    "agora_averaging_success_ratio": ("gauge", "worker", "Averaging success of the last averaging round."),
    "agora_matchmaking_seconds": ("gauge", "worker", "Matchmaking time of the last averaging round."),
    "agora_group_size": ("gauge", "worker", "Peers in the last averaging round's group."),
    "agora_sync_phase": ("gauge", "worker", "1 for the worker's current phase (label phase: weight_sync, "
                                            "optimizer_sync, active), 0 for the others."),
    "agora_dht_operations_total": ("counter", "worker", "DHT operations by kind (label op)."),
    "agora_dht_seconds_total": ("counter", "worker", "Seconds spent in DHT operations by kind (label op)."),
}
"""Every metric a node exports: its Prometheus type, which nodes export it, what it means."""


class NodeMetrics:
    """A node's metrics registry. ``sample`` returns the node's counters as {metric: value or {labels: value}}."""

    def __init__(self, run: Run, role: str, stage: str, instance: str, sample: Callable[[], dict]) -> None:
        self.run, self.labels = run, {"run": run.metadata.name, "role": role, "stage": stage, "instance": instance}
        self.sample = sample
        self.rounds: dict[str, int] = {}
        self.last_round: dict = {}
        self.grad_norm: Optional[float] = None
        self.sent = self.received = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._stop = threading.Event()
        self._server = None

    # -- events (a worker's listener) -----------------------------------------------------------

    def __call__(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "round":
            status = str(event.get("status", ""))
            self.rounds[status] = self.rounds.get(status, 0) + 1
            self.sent += int(event.get("bytes_sent") or 0)
            self.received += int(event.get("bytes_received") or 0)
            if status != "skipped":
                self.last_round = event
        elif kind == "step" and event.get("grad_norm") is not None:
            self.grad_norm = float(event["grad_norm"])

    # -- prometheus_client's collector protocol ---------------------------------------------------

    def collect(self):
        values = dict(self.sample())
        values["agora_ram_bytes"] = _ram_bytes()
        vm = psutil.virtual_memory()
        values["agora_host_memory_available_ratio"] = vm.available / vm.total
        values.update(self._events())
        names, base = list(LABELS), [self.labels[k] for k in LABELS]
        for name, value in values.items():
            if value is None or name not in METRICS:
                continue
            kind = METRICS[name][0]
            family_name = name.removesuffix("_total") if kind == "counter" else name
            extra = sorted({k for v in value for k in dict(v)}) if isinstance(value, dict) else []
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(family_name, METRICS[name][2], labels=names + extra)
            if isinstance(value, dict):
                for key, v in value.items():
                    family.add_metric(base + [dict(key)[k] for k in extra], float(v))
            else:
                family.add_metric(base, float(value))
            yield family

    def _events(self) -> dict:
        out: dict = {}
        if self.rounds:
            out["agora_rounds_total"] = {(("status", s),): n for s, n in self.rounds.items()}
            out["agora_sent_bytes_total"], out["agora_received_bytes_total"] = self.sent, self.received
        r = self.last_round
        if r:
            out["agora_reduce_success_ratio"] = r.get("reduce_success")
            out["agora_averaging_success_ratio"] = r.get("averaging_success")
            out["agora_matchmaking_seconds"] = r.get("matchmaking_s")
            out["agora_group_size"] = r.get("group_size")
        out["agora_grad_norm"] = self.grad_norm
        return out

    # -- exposure ---------------------------------------------------------------------------------

    def start(self, token: Callable[[], Optional[str]] = lambda: None) -> Optional[str]:
        """Serve /metrics and/or start pushing, as ``monitoring`` says; returns the /metrics URL when serving."""
        m, url = self.run.monitoring, None
        if m.metrics_port is not None:
            self._server, _ = start_http_server(m.metrics_port, m.metrics_host, registry=self.registry)
            port = self._server.server_port
            url = f"http://{m.metrics_host}:{port}/metrics"
            if m.targets_dir:
                target = [{"targets": [f"{m.metrics_host}:{port}"], "labels": dict(self.labels)}]
                storage.write_bytes_atomic(os.path.join(m.targets_dir, f"{self.labels['instance']}.json"),
                                           json.dumps(target).encode())
        if m.push_gateway:
            threading.Thread(target=self._push_loop, args=(token,), name="metrics-push", daemon=True).start()
        return url

    def push(self, token: Optional[str]) -> None:
        def handler(url, method, timeout, headers, data):
            bearer = token or os.environ.get(PUSH_TOKEN_ENV)
            return default_handler(url, method, timeout,
                                   [*headers, *([("Authorization", f"Bearer {bearer}")] if bearer else [])], data)

        push_to_gateway(self.run.monitoring.push_gateway, job="agora", registry=self.registry,
                        grouping_key={"instance": self.labels["instance"]}, timeout=10, handler=handler)

    def _push_loop(self, token) -> None:
        log = logs.get("metrics")
        while not self._stop.wait(self.run.monitoring.push_interval_s):
            try:
                self.push(token())
            except Exception as e:  # a gateway away for a while is not the node's end
                log.warning("metrics push failed", error=f"{type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            m = self.run.monitoring
            if m.targets_dir:
                try:
                    os.unlink(os.path.join(m.targets_dir, f"{self.labels['instance']}.json"))
                except OSError:
                    pass


def _ram_bytes() -> int:
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


def gpu_memory_bytes(total: bool = False) -> Optional[int]:
    """Allocated (or with TOTAL, the device's) GPU memory; None off CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(0).total_memory if total else torch.cuda.memory_allocated())
    except Exception:
        return None


def worker_sample(node) -> Callable[[], dict]:
    """The counters of a :class:`~agoractl.runtime.worker_node.WorkerNode` as metric values."""

    def sample() -> dict:
        w, s = node.worker, node.worker.stats
        batches = sum(s.batches.values())
        return {
            "agora_data_await_seconds_total": s.idle_s, "agora_compute_seconds_total": s.compute_s,
            "agora_coalesced_batch_size": s.coalesced_sum / batches if batches else None,
            "agora_coalesced_batch_size_max": s.max_coalesced,
            "agora_samples_total": s.backward_samples,
            "agora_tokens_total": s.backward_samples * node.run.model.seq_len,
            "agora_gpu_memory_bytes": gpu_memory_bytes(), "agora_gpu_memory_total_bytes": gpu_memory_bytes(True),
            "agora_step": w.progress.step,
            "agora_sync_phase": {(("phase", p),): int(p == w.phase)
                                 for p in ("weight_sync", "optimizer_sync", "active")},
            "agora_dht_operations_total": {(("op", k),): v[0] for k, v in node.dht_calls.items()} or None,
            "agora_dht_seconds_total": {(("op", k),): v[1] for k, v in node.dht_calls.items()} or None,
        }

    return sample


def trainer_sample(trainer) -> Callable[[], dict]:
    """The counters of a :class:`~agoractl.runtime.trainer.Trainer` as metric values."""

    def sample() -> dict:
        s = trainer.stats
        return {"agora_samples_total": s.completed, "agora_tokens_total": s.completed * trainer.run.model.seq_len,
                "agora_step": max(s.loss, default=0), "agora_loss": trainer.last_loss}

    return sample
