"""The manifest's ``dashboard`` section: the public Dashboard (report §3.6.4) that ``agoractl launch dashboard``
serves from the Health Monitor's database and Prometheus, and how it scores contributions (report §3.1:
contributed FLOPs, plus credit for the time a node was present).
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Score(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    points_per_pflop: float = Field(1.0, ge=0)
    """Score points per PFLOP a worker contributed (samples it trained x its stage's FLOPs per sample)."""
    points_per_hour: float = Field(1.0, ge=0)
    """Presence credit: score points per hour a node was present in the run (from its presence history)."""


class Dashboard(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    enabled: bool = False
    """`launch swarm` with monitoring.enabled also starts the Dashboard (a utility node beside the Health Monitor,
    on its database and the swarm's Prometheus) on host:port and prints its URL."""
    host: str = "127.0.0.1"
    """Address `agoractl launch dashboard` listens on."""
    port: int = Field(8480, ge=1, le=65535)
    """TCP port it listens on (`--port` overrides)."""
    cache_s: float = Field(5.0, gt=0, le=3600)
    """Cache period, in seconds: API responses say `Cache-Control: public, max-age=cache_s` and each endpoint
    reads the database at most once per period, whatever the request rate."""
    refresh_s: float = Field(10.0, ge=1)
    """Seconds between the page's automatic refreshes."""
    prometheus_url: Optional[str] = Field(None, pattern=r"^https?://[^\s/]+(/[^\s]*)?$")
    """Prometheus with the run's metrics (live telemetry, SPARTA health per stage); null = those panels are
    empty. `launch dashboard --prometheus URL` overrides."""
    score: Score = Score()
    """How contributions are scored on the leaderboard."""
    accelerator_tflops: dict[str, float] = {}
    """Spec-sheet dense BF16 TFLOP/s by accelerator model (as nodes report it to the Authorizer), for the
    efficiency eta = tokens/s / pooled TFLOP/s (report §5.4); eta is shown only when every present worker's
    accelerator is listed here."""

    @field_validator("accelerator_tflops")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [name for name, tflops in v.items() if not tflops > 0]
        if bad:
            raise ValueError(f"TFLOP/s must be > 0; got {', '.join(f'{n}: {v[n]}' for n in bad)}")
        return v
