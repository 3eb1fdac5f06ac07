"""The manifest's ``local.hosts`` section: ``launch swarm`` on emulated hosts (report §3.5.2.2).

With ``enabled``, every node of a local swarm runs in its own Linux network namespace with its own address,
the namespaces joined by veth pairs on one bridge, and links shaped per node kind, role and stage:
bandwidth by ``tc tbf`` on the veths, round-trip time by a user-space delay line (this kernel has no
``netem``; :mod:`agoractl.runtime.delayline`). As in §3.5.2.2 the default shapes nobody: add a rule for the
contributors. Root only (:mod:`agoractl.runtime.hosts`).
"""

from __future__ import annotations

import ipaddress
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Shape(BaseModel):
    """One shaping rule: which nodes, and their link. The first rule that matches a node applies."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    kind: Literal["worker", "trainer", "dht", "any"] = "worker"
    """Node kind the rule applies to."""
    role: Optional[Literal["operator", "contributor"]] = None
    """Worker role the rule applies to (null: any)."""
    stage: Optional[str] = None
    """Stage name the rule applies to (null: any)."""
    bandwidth_mbps: Optional[float] = Field(None, gt=0)
    """Upload and download bandwidth of the node's link, in Mbit/s (tc tbf each way); null = unlimited."""
    rtt_ms: float = Field(0.0, ge=0, le=2000)
    """The node's access-link round-trip time in ms: a path between two nodes gets the sum of theirs, half of it
    each way (the delay line); 0 = none."""

    def matches(self, kind: str, role: Optional[str], stage: Optional[str]) -> bool:
        return ((self.kind in ("any", kind)) and (self.role is None or self.role == role)
                and (self.stage is None or self.stage == stage))


class Hosts(BaseModel):
    """Emulated hosts for ``launch swarm``: one network namespace per node (root only)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    enabled: bool = False
    """Place every node of `launch swarm` in its own network namespace with its own address (root only)."""
    subnet: str = "10.77.0.0/16"
    """Addresses for the hosts: each run takes the first free /24 in it; the launcher's own side is .254."""
    contributors_per_stage: int = Field(0, ge=0)
    """Of local.workers_per_stage, this many start as contributors (report §3.3.1: send, never reduce)."""
    shaping: list[Shape] = []
    """Link rules, first match wins; a node no rule matches is unshaped (report §3.5.2.2 shapes contributors)."""

    @field_validator("subnet")
    @classmethod
    def _subnet(cls, value: str) -> str:
        net = ipaddress.ip_network(value, strict=True)
        if net.version != 4 or net.prefixlen > 24:
            raise ValueError(f"must be an IPv4 network of /24 or larger; got {value}")
        return value

    def shape_for(self, kind: str, role: Optional[str] = None, stage: Optional[str] = None) -> Optional[Shape]:
        return next((s for s in self.shaping if s.matches(kind, role, stage)), None)


def hosts_errors(hosts: Hosts, stage_names: list[str], workers_per_stage: int) -> list[tuple[str, str]]:
    """Rules of ``local.hosts`` that span sections, as (dotted path, message) pairs."""
    out = []
    if hosts.contributors_per_stage >= workers_per_stage and hosts.contributors_per_stage:
        out.append(("local.hosts.contributors_per_stage",
                    f"must leave an operator in each stage: below local.workers_per_stage ({workers_per_stage})"))
    for i, rule in enumerate(hosts.shaping):
        if rule.stage is not None and rule.stage not in stage_names:
            out.append((f"local.hosts.shaping[{i}].stage",
                        f"no stage {rule.stage!r}; stages are {', '.join(stage_names)}"))
    return out
