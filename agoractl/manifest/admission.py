"""The manifest's ``admission`` section: who may join a run and on what terms (report §3.6.1, footnotes 4-5).

Read by the Authorizer (``agoractl launch authorizer``) as its starting policy, which an operator may then
change while it runs (``agoractl auth policy set``); read by workers and trainers to know whether they must
join through an Authorizer and whose signature to trust. Every check is switched on independently.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class Checks(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    capability: bool = True
    """RAM, accelerator memory and model, and the bandwidth and latency the node measured against the Authorizer."""
    integrity: bool = False
    """The node's agoractl version and package hash must be on allowed_versions / allowed_package_hashes."""
    reachability: bool = False
    """The Authorizer dials the node's announced multiaddr before admitting it."""
    accountability: bool = False
    """The node's account must authenticate (an account token) before admission."""


class Admission(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    enabled: bool = False
    """Admission on: nodes join through the Authorizer, and every stage RPC, averaging RPC and DHT record of the
    run needs a valid credential."""
    authorizer: Optional[str] = Field(None, pattern=r"^https?://[^\s/]+(/[^\s]*)?$")
    """The Authorizer's base URL (http://host:port); null = `launch swarm` starts one on loopback."""
    authority_public_key: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9_-]{43}$")
    """The authority's Ed25519 public key (the line `agoractl auth keygen` prints); null = fetched once from the
    Authorizer."""
    checks: Checks = Checks()
    """Which admission checks run."""
    min_vram_gb: float = Field(24.0, ge=0)
    """Minimum accelerator memory, in GB (report footnote 4: 24)."""
    min_ram_gb: float = Field(80.0, ge=0)
    """Minimum host memory, in GB (footnote 4: 80)."""
    min_bandwidth_mbps: float = Field(200.0, ge=0)
    """Minimum download bandwidth, in Mbit/s (footnote 4: 200)."""
    max_latency_ms: float = Field(80.0, gt=0)
    """Maximum network latency, in ms (footnote 4: 80)."""
    allowed_accelerators: list[str] = []
    """Accepted accelerator models; empty = any."""
    allowed_versions: list[str] = []
    """Accepted agoractl versions (integrity check); empty = any."""
    allowed_package_hashes: list[str] = []
    """Accepted package hashes (integrity check); empty = any."""
    max_contributors: int = Field(60, ge=0)
    """Most contributor (non-operator) nodes admitted at once (report §5.3.3: 60)."""
    stage_caps: dict[str, int] = {}
    """Most workers per stage, by stage name; a stage not named has no cap (report: a higher cap on the bodies)."""
    contributor_stages: list[str] = []
    """Stages contributors may be placed on; empty = any (report: bodies only)."""
    operators_only_until_step: int = Field(0, ge=0)
    """Only operators' nodes are admitted until the run reaches this step (report §5.1.0.1); 0 = from the start."""
    joins_per_minute: float = Field(10.0, gt=0)
    """Admission rate limit, in joins per minute (a burst of one)."""
    credential_ttl_s: float = Field(300.0, gt=0)
    """Seconds a credential stays valid; nodes renew it at half its life. Revocation = declining to renew."""


def admission_errors(adm: Admission, stage_names: list[str]) -> list[tuple[str, str]]:
    """Cross-field rules of the section: stage names it mentions must exist."""
    out = []
    for field, names in (("stage_caps", list(adm.stage_caps)), ("contributor_stages", adm.contributor_stages)):
        unknown = [n for n in names if n not in stage_names]
        if unknown:
            out.append((f"admission.{field}", f"no stage {', '.join(unknown)}; stages are {', '.join(stage_names)}"))
    for name, cap in adm.stage_caps.items():
        if cap < 0:
            out.append((f"admission.stage_caps.{name}", f"must be >= 0; got {cap}"))
    return out
