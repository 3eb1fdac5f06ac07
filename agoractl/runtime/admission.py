"""A worker's or trainer's way into a run with admission on (report §3.6.1): measure the link to the
Authorizer, report hardware, queue, get a stage and a credential, keep it renewed, and check peers.

:func:`enter` is the one call the nodes make after their DHT node is up (they need its peer id to bind the
credential to). It returns None when the manifest's admission is off. Identity comes from the environment:
``AGORA_NODE_ID`` (default: role and the peer id's tail), ``AGORA_ACCOUNT`` and ``AGORA_ACCOUNT_TOKEN``.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import httpx
import psutil

from agoractl import __version__, logs
from agoractl.auth import keys
from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.schema import Run
from agoractl.runtime import peer_auth
from agoractl.runtime.peer_auth import CredentialValidator, PeerAuth

PROBE_BYTES = 4 << 20


@dataclass
class Admitted:
    """What the Authorizer granted, kept fresh by a renewal thread."""

    url: str
    node_id: str
    peer_id: str
    stage: Optional[str]
    token: str
    expires_at: float
    auth: PeerAuth
    dht: object
    renewals: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    step: Callable[[], int] = lambda: 0
    """The node's training step, reported with each renewal (the Authorizer's operators-only window)."""
    listeners: list = field(default_factory=list)
    """Called with (credential, ban list) whenever either changes (the averager's process: averaging_auth)."""
    sources: list = field(default_factory=list)
    """More refusal counts for :func:`summary`: callables returning {"checked": n, "refused": {key: n}}."""

    def current(self) -> str:
        return self.token

    def publish(self, token: str, bans: frozenset) -> None:
        """Hand the current credential and ban list to this node's DHT validator and to every listener."""
        peer_auth.push(self.dht, token, bans)
        for listener in self.listeners:
            listener(token, bans)


def package_hash() -> str:
    """SHA-256 over agoractl's own source files (the integrity check's allow-list entry)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def hardware() -> dict:
    vram, accel = 0.0, ""
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            vram, accel = props.total_memory / 1e9, props.name
    except Exception:
        pass
    return {"ram_gb": round(psutil.virtual_memory().total / 1e9, 2), "vram_gb": round(vram, 2), "accelerator": accel}


def measure(client: httpx.Client) -> dict:
    """Median round trip of five pings (ms) and one 4 MiB download (Mbit/s), against the Authorizer."""
    rtts = []
    for _ in range(5):
        t0 = time.perf_counter()
        client.get("/v1/ping").raise_for_status()
        rtts.append((time.perf_counter() - t0) * 1000)
    t0 = time.perf_counter()
    client.get("/v1/probe", params={"size": PROBE_BYTES}).raise_for_status()
    mbps = PROBE_BYTES * 8 / 1e6 / max(time.perf_counter() - t0, 1e-6)
    return {"latency_ms": round(statistics.median(rtts), 2), "bandwidth_mbps": round(mbps, 1)}


def authority_key(run: Run, url: Optional[str]) -> str:
    """The authority's public key text: from the manifest, else fetched once from the Authorizer."""
    if run.admission.authority_public_key:
        return run.admission.authority_public_key
    if not url:
        raise UsageError("admission.enabled needs admission.authorizer (or admission.authority_public_key)",
                         hint="pass --authorizer http://HOST:PORT or set admission.authorizer in the manifest")
    try:
        text = httpx.get(url.rstrip("/") + "/v1/info", timeout=30).json()["authority_public_key"]
        keys.parse_public(text)
        return text
    except (httpx.HTTPError, KeyError, ValueError) as e:
        raise RuntimeFailure(f"Authorizer {url}: {e}", hint="is `agoractl launch authorizer` running there?") from None


def guard(run: Run, dht):
    """DHT, with the run's record validator installed when admission is on (every node, seeds included:
    records then carry a credential, and one without is neither stored nor read)."""
    if run.admission.enabled:
        try:
            auth = PeerAuth(run.metadata.name, authority_key(run, run.admission.authorizer))
            dht.add_validators([CredentialValidator(run.metadata.name, auth.public_text, run.stage_names())])
        except BaseException:
            dht.shutdown()
            raise
        dht.agora_auth = auth
    return dht


def enter(run: Run, dht, role: str, timeout_s: float = 600.0) -> Optional[Admitted]:
    """Join through the Authorizer and start renewing; None when admission is off. RuntimeFailure when refused."""
    if not run.admission.enabled:
        return None
    url = (run.admission.authorizer or "").rstrip("/")
    peer = dht.peer_id.to_base58()
    holder: dict = {}
    auth = getattr(dht, "agora_auth", None) or guard(run, dht).agora_auth
    log = logs.get("admission")
    body = {"node_id": os.environ.get("AGORA_NODE_ID") or f"{role}-{peer[-10:]}",
            "account": os.environ.get("AGORA_ACCOUNT") or "anonymous", "role": role, "peer_id": peer,
            "account_token": os.environ.get("AGORA_ACCOUNT_TOKEN") or None,
            "multiaddrs": [str(a) for a in dht.get_visible_maddrs()], "hardware": hardware(),
            "client": {"version": __version__, "package_hash": package_hash()}, "ready": True}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=30) as client:
        try:
            body["measurements"] = measure(client)
            while True:
                r = client.post("/v1/join", json=body)
                out = r.json()
                if out.get("status") == "admitted":
                    break
                if out.get("status") != "queued":
                    raise RuntimeFailure(f"the Authorizer refused this {role}: {out.get('reason')} "
                                         f"({out.get('detail', '')})", hint="see `agoractl auth report`")
                if time.monotonic() > deadline:
                    raise RuntimeFailure(f"still queued after {timeout_s:.0f} s ({out.get('reason')})")
                log.info("queued", position=out.get("position"), reason=out.get("reason"))
                time.sleep(min(float(out.get("retry_after_s") or 1.0), 5.0))
        except httpx.HTTPError as e:
            raise RuntimeFailure(f"Authorizer {url}: {e}",
                                 hint="is `agoractl launch authorizer` running there?") from None
    holder["token"] = out["credential"]
    peer_auth.push(dht, holder["token"], auth.bans)
    adm = Admitted(url, body["node_id"], peer, out.get("stage"), out["credential"], out["expires_at"], auth, dht)
    threading.Thread(target=_renew_loop, args=(adm, holder, log), daemon=True, name="credential-renewal").start()
    log.info("admitted", node_id=adm.node_id, stage=adm.stage)
    return adm


def _renew_loop(adm: Admitted, holder: dict, log) -> None:
    """Renew once less than half the credential's life is left, and refresh the ban list meanwhile (every
    ttl/8, at most 10 s). While the Authorizer does not answer (down, restarting), retry every second: the
    credential keeps running out, so an outage of up to about 3/8 of its life costs this node nothing. After
    expiry its records and requests are refused everywhere (revocation is the Authorizer declining to renew)."""
    ttl = max(adm.expires_at - time.time(), 1.0)
    period = wait = min(ttl / 8, 10.0)
    with httpx.Client(base_url=adm.url, timeout=min(30.0, max(ttl / 4, 5.0))) as client:
        while not adm.stop.wait(wait):
            wait = period
            try:
                bans = frozenset(client.get("/v1/bans").json().get("bans", []))
                if bans != adm.auth.bans:
                    adm.auth.bans = bans
                    adm.publish(holder["token"], bans)
                if adm.expires_at - time.time() > ttl / 2:
                    continue
                out = client.post("/v1/renew", json={"credential": holder["token"], "peer_id": adm.peer_id,
                                                   "step": int(adm.step())}).json()
                if out.get("status") == "admitted":
                    holder["token"], adm.token, adm.expires_at = out["credential"], out["credential"], out["expires_at"]
                    adm.publish(holder["token"], adm.auth.bans)
                    adm.renewals += 1
                else:
                    log.warning("renewal declined", reason=out.get("reason"))
            except (httpx.HTTPError, ValueError) as e:
                wait = min(period, 1.0)
                log.warning("renewal failed; retrying", error=f"{type(e).__name__}: {e}")


def summary(adm: Optional[Admitted]) -> Optional[dict]:
    """For a node's final statistics: its credential and what it refused (None when admission is off)."""
    if adm is None:
        return None
    stats = peer_auth.merged_stats(adm.auth, adm.dht)
    for source in adm.sources:
        more = source()
        stats["checked"] += more.get("checked", 0)
        stats["refused"].update(more.get("refused", {}))
    return {"node_id": adm.node_id, "stage": adm.stage, "renewals": adm.renewals, **stats}
