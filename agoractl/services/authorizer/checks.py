"""The admission checks of one join request, each switched on by the policy (report §3.6.1.1-3).

Each returns None when the node passes, else ``(reason, detail)`` with a reason code from
:data:`agoractl.services.authorizer.service.REASONS`.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
from typing import Optional

from agoractl.manifest.admission import Admission

Refusal = Optional[tuple[str, str]]


def capability(policy: Admission, hw: dict, meas: dict) -> Refusal:
    short = []
    if hw.get("ram_gb", 0) < policy.min_ram_gb:
        short.append(f"RAM {hw.get('ram_gb', 0)} < {policy.min_ram_gb} GB")
    if hw.get("vram_gb", 0) < policy.min_vram_gb:
        short.append(f"VRAM {hw.get('vram_gb', 0)} < {policy.min_vram_gb} GB")
    if policy.allowed_accelerators and hw.get("accelerator") not in policy.allowed_accelerators:
        short.append(f"accelerator {hw.get('accelerator')!r} not allowed")
    if meas.get("bandwidth_mbps", 0) < policy.min_bandwidth_mbps:
        short.append(f"bandwidth {meas.get('bandwidth_mbps', 0):.0f} < {policy.min_bandwidth_mbps} Mbit/s")
    if meas.get("latency_ms", 1e9) > policy.max_latency_ms:
        short.append(f"latency {meas.get('latency_ms', 1e9):.0f} > {policy.max_latency_ms} ms")
    return ("below_requirements", "; ".join(short)) if short else None


def integrity(policy: Admission, client: dict) -> Refusal:
    if policy.allowed_versions and client.get("version") not in policy.allowed_versions:
        return "outdated_client", f"version {client.get('version')!r} not in {policy.allowed_versions}"
    if policy.allowed_package_hashes and client.get("package_hash") not in policy.allowed_package_hashes:
        return "outdated_client", "package hash not allowed"
    return None


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def account_token_ok(stored_hash: Optional[str], token: Optional[str]) -> bool:
    return bool(stored_hash and token) and hmac.compare_digest(stored_hash, token_hash(token))


def reachable(multiaddrs: list[str], timeout_s: float = 2.0) -> Refusal:
    """Dial the first /ip4|ip6|dns/.../tcp/PORT address the node announced."""
    for addr in multiaddrs:
        parts = addr.strip("/").split("/")
        if len(parts) >= 4 and parts[0] in ("ip4", "ip6", "dns", "dns4", "dns6") and parts[2] == "tcp":
            try:
                with socket.create_connection((parts[1], int(parts[3])), timeout=timeout_s):
                    return None
            except (OSError, ValueError) as e:
                return "unreachable", f"{addr}: {e}"[:200]
    return "unreachable", "no dialable /tcp multiaddr announced"
