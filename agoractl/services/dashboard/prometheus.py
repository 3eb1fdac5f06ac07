"""Live telemetry for the Dashboard from Prometheus's HTTP API (the metrics in docs/metrics.md): SPARTA health
per stage (averaging rounds by outcome, mean averaging success) and each node's latest gauges. Prometheus
unreachable or not configured is an ``error`` field in the answer, never a failed request."""

from __future__ import annotations

import math
from typing import Optional

import httpx

TELEMETRY = {"ram_bytes": "agora_ram_bytes", "step": "agora_step", "coalesced": "agora_coalesced_batch_size",
             "samples_per_s": "rate(agora_samples_total[{window}])", "loss": "agora_loss",
             "averaging_success": "agora_averaging_success_ratio"}
"""Field -> PromQL of each node's telemetry (the run's selector is added to the metric)."""


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _sel(metric: str, run: str, instance: Optional[str] = None) -> str:
    labels = f'run="{_label(run)}"' + (f',instance="{_label(instance)}"' if instance else "")
    return f"{metric}{{{labels}}}"


def _num(value: str) -> Optional[float]:
    x = float(value)
    return x if math.isfinite(x) else None


def query(url: str, promql: str, timeout_s: float = 5.0) -> list[dict]:
    r = httpx.get(f"{url.rstrip('/')}/api/v1/query", params={"query": promql}, timeout=timeout_s)
    r.raise_for_status()
    return r.json()["data"]["result"]


def stage_health(url: Optional[str], run: str) -> dict:
    """{stage: {"rounds": {status: n}, "averaging_success": mean or None}}, or {"error": ...}."""
    if not url:
        return {"error": "no Prometheus configured (dashboard.prometheus_url)"}
    try:
        rounds = query(url, f"sum by (stage, status) ({_sel('agora_rounds_total', run)})")
        success = query(url, f"avg by (stage) ({_sel('agora_averaging_success_ratio', run)})")
    except (httpx.HTTPError, KeyError, ValueError) as e:
        return {"error": f"Prometheus {url}: {type(e).__name__}: {e}"}
    out: dict = {}
    for r in rounds:
        st = out.setdefault(r["metric"].get("stage", ""), {"rounds": {}, "averaging_success": None})
        st["rounds"][r["metric"].get("status", "")] = int(_num(r["value"][1]) or 0)
    for r in success:
        st = out.setdefault(r["metric"].get("stage", ""), {"rounds": {}, "averaging_success": None})
        st["averaging_success"] = _num(r["value"][1])
    return {"stages": out}


def telemetry(url: Optional[str], run: str, instance: Optional[str] = None, window: str = "1m") -> dict:
    """{"nodes": [{instance, role, stage, <field>: value...}]} for the run (or one INSTANCE), or {"error": ...}."""
    if not url:
        return {"error": "no Prometheus configured (dashboard.prometheus_url)"}
    nodes: dict[str, dict] = {}
    try:
        for field, expr in TELEMETRY.items():
            if expr.startswith("rate("):
                promql = f"rate({_sel('agora_samples_total', run, instance)}[{window}])"
            else:
                promql = _sel(expr, run, instance)
            for r in query(url, promql):
                m = r["metric"]
                key = m.get("instance", "")
                n = nodes.setdefault(key, {"instance": key, "role": m.get("role", ""), "stage": m.get("stage", "")})
                n[field] = _num(r["value"][1])
    except (httpx.HTTPError, KeyError, ValueError) as e:
        return {"error": f"Prometheus {url}: {type(e).__name__}: {e}"}
    return {"nodes": sorted(nodes.values(), key=lambda n: (n["role"], n["stage"], n["instance"]))}
