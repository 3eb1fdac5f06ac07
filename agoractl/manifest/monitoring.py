"""The manifest's ``monitoring`` section: the Health Monitor (report §3.6.2) and the metrics every node exports
(report §3.6.3). Read by ``agoractl launch health``, ``agoractl status``, every worker and trainer, and
``launch swarm`` (which starts the monitor, a push gateway and a Prometheus server when ``enabled``).
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class Monitoring(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    enabled: bool = False
    """`launch swarm` also starts the Health Monitor, a Prometheus push gateway and a Prometheus server that
    scrapes the swarm (Debian's `prometheus`, `prometheus-pushgateway`), and prints their URLs."""
    interval_s: float = Field(5.0, gt=0)
    """Seconds between the Health Monitor's reads of the run's DHT records (and its checks)."""
    min_replicas: int = Field(1, ge=0)
    """Serving replicas (optimizer_sync or active) every stage needs; fewer raises a stage_below_minimum alert."""
    stall_after_s: float = Field(120.0, gt=0)
    """Seconds without a new completed sample in any trainer report, once training began, before the
    progress_stalled alert."""
    database_url: Optional[str] = None
    """The monitor's database (postgresql://... or sqlite:///...); null = $AGORA_DATABASE_URL, else SQLite at
    local.run_dir/health/health.db. A password never belongs here: use the environment."""
    metrics_port: Optional[int] = Field(None, ge=0, le=65535)
    """Operators: serve Prometheus /metrics on this TCP port (0 = any free port); null = do not serve."""
    metrics_host: str = "127.0.0.1"
    """Address the /metrics endpoint listens on."""
    push_gateway: Optional[str] = Field(None, pattern=r"^https?://[^\s/]+(/[^\s]*)?$")
    """Contributors: push metrics to this push gateway (URL) every push_interval_s, with a bearer token (the
    Authorizer's credential when admission is on, else $AGORA_PUSH_TOKEN); null = do not push."""
    push_interval_s: float = Field(15.0, gt=0)
    """Seconds between pushes to the push gateway."""
    scrape_interval_s: float = Field(5.0, gt=0)
    """Prometheus's scrape and rule-evaluation interval in `launch swarm`'s monitoring stack."""
    targets_dir: Optional[str] = None
    """A directory where each node serving /metrics writes a Prometheus file_sd target file (its address and
    labels); `launch swarm` sets it. Null = none."""
