"""Signed short-lived credentials (report §3.6.1.5) and their check.

A credential names the run, the node, its account, role and stage, the node's libp2p peer id, an expiry and
a serial, and carries the authority's Ed25519 signature over those fields. On the wire it is one token:
``base64url(canonical JSON) "." base64url(signature)``.

Binding to the peer id is what makes a stolen credential useless: libp2p's secure channel (Noise) has
already proved that the caller holds the private key of the peer id it connects from, fresh for this
connection, so a checker compares the credential's ``peer_id`` with the authenticated remote peer and a
replayed credential of another peer fails with ``wrong_peer``. Both sides do the check (each RPC's caller
checks the callee's announced credential before sending to it, the callee checks the caller's), which gives
the report's mutual, replay-proof handshake without a second round trip.

Every refusal carries one reason code from :data:`REFUSALS`, so callers count them apart.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Optional

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agoractl.auth.keys import key_id

REFUSALS = ("missing", "malformed", "other_authority", "forged", "wrong_peer", "expired", "wrong_run",
            "wrong_role", "wrong_stage", "banned")
"""Why a credential is refused: absent; not a token; signed by another key; signature does not match (a
tampered field); presented by a peer it is not bound to; past its expiry; for another run, role or stage;
its node or account is on the ban list."""

MAX_TOKEN_CHARS = 4096


class CredentialRefused(Exception):
    """A credential failed a check; ``reason`` is one of :data:`REFUSALS`."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in REFUSALS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Credential:
    run: str
    node_id: str
    account: str
    role: str
    """worker, trainer, or admin (the operator's own commands)."""
    stage: str
    """The stage a worker serves; empty for trainers and admins."""
    peer_id: str
    """The node's libp2p peer id (base58); empty for admins, who do not speak libp2p."""
    issued_at: float
    expires_at: float
    serial: int
    authority: str
    """Fingerprint of the signing key (:func:`agoractl.auth.keys.key_id`)."""
    operator: bool = False

    def payload(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue(key: Ed25519PrivateKey, *, run: str, node_id: str, account: str, role: str, stage: str, peer_id: str,
          ttl_s: float, serial: int, operator: bool = False, now: Optional[float] = None) -> str:
    """A signed token valid for ttl_s seconds from now."""
    now = time.time() if now is None else now
    cred = Credential(run=run, node_id=node_id, account=account, role=role, stage=stage, peer_id=peer_id,
                      issued_at=now, expires_at=now + ttl_s, serial=serial, authority=key_id(key),
                      operator=operator)
    return sign(key, cred)


def sign(key: Ed25519PrivateKey, cred: Credential) -> str:
    payload = cred.payload()
    return f"{_b64(payload)}.{_b64(key.sign(payload))}"


def decode(token: Optional[str]) -> Credential:
    """The credential's fields, unverified (raises ``missing`` or ``malformed``)."""
    if not token:
        raise CredentialRefused("missing")
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS or token.count(".") != 1:
        raise CredentialRefused("malformed", "not a token")
    body, _ = token.split(".")
    try:
        fields = json.loads(_unb64(body))
        return Credential(**fields)
    except (binascii.Error, ValueError, TypeError) as e:
        raise CredentialRefused("malformed", str(e)[:80]) from None


def verify(token: Optional[str], public: Ed25519PublicKey, *, run: str, peer_id: Optional[str] = None,
           role: Optional[str | Iterable[str]] = None, stage: Optional[str] = None,
           banned: Iterable[str] = (), now: Optional[float] = None) -> Credential:
    """The credential if it is valid for this caller, else :class:`CredentialRefused` with its reason.

    ``peer_id`` is the authenticated remote peer (from libp2p's secure channel); None skips the binding
    check (only for callers that do not speak libp2p: the operator's admin commands). ``banned`` holds node
    ids and account names.
    """
    return check(signed(token, public, key_id(public)), run=run, peer_id=peer_id, role=role, stage=stage,
                 banned=banned, now=now)


def signed(token: Optional[str], public: Ed25519PublicKey, authority: str) -> Credential:
    """The credential if `token` is well formed and signed by `public` (whose :func:`key_id` is `authority`);
    else ``missing``, ``malformed``, ``other_authority`` or ``forged``. Says nothing of whom it is valid for."""
    cred = decode(token)
    if cred.authority != authority:
        raise CredentialRefused("other_authority", cred.authority)
    body, sig = token.split(".")
    try:
        public.verify(_unb64(sig), _unb64(body))
    except (InvalidSignature, binascii.Error, ValueError):
        raise CredentialRefused("forged", "signature does not match") from None
    return cred


def check(cred: Credential, *, run: str, peer_id: Optional[str] = None, role: Optional[str | Iterable[str]] = None,
          stage: Optional[str] = None, banned: Iterable[str] = (), now: Optional[float] = None) -> Credential:
    """`cred` (signature already checked) if it is valid now for this caller, else :class:`CredentialRefused`
    (``wrong_peer``, ``expired``, ``wrong_run``, ``wrong_role``, ``wrong_stage`` or ``banned``)."""
    if peer_id is not None and cred.peer_id != peer_id:
        raise CredentialRefused("wrong_peer", f"bound to {cred.peer_id[:12]}..., presented by {peer_id[:12]}...")
    if cred.expires_at <= (time.time() if now is None else now):
        raise CredentialRefused("expired")
    if cred.run != run:
        raise CredentialRefused("wrong_run", cred.run)
    if role is not None and cred.role not in ((role,) if isinstance(role, str) else tuple(role)):
        raise CredentialRefused("wrong_role", cred.role)
    if stage is not None and cred.stage != stage:
        raise CredentialRefused("wrong_stage", cred.stage)
    bans = banned if isinstance(banned, (set, frozenset)) else set(banned)
    if cred.node_id in bans or cred.account in bans:
        raise CredentialRefused("banned", cred.node_id)
    return cred


class Verifier:
    """:func:`verify` for one authority, for checkers that see the same tokens again and again (a worker checks
    the trainers' credential on every stage request, a DHT node the storers' on every record).

    The signature check (Ed25519, a few hundred microseconds on a busy CPU) depends on the token and the key
    alone, so its result is remembered per token (at most :attr:`REMEMBERED`; all forgotten when full); whom a
    credential is valid for — its peer, expiry, run, role, stage and the ban list — is checked on every call.
    A token that failed its signature is not remembered: it is checked again each time it is presented."""

    REMEMBERED = 4096

    def __init__(self, public: Ed25519PublicKey):
        self.public, self.authority = public, key_id(public)
        self._signed: dict[str, Credential] = {}

    def verify(self, token: Optional[str], *, run: str, peer_id: Optional[str] = None,
               role: Optional[str | Iterable[str]] = None, stage: Optional[str] = None,
               banned: Iterable[str] = (), now: Optional[float] = None) -> Credential:
        cred = self._signed.get(token) if isinstance(token, str) else None
        if cred is None:
            cred = signed(token, self.public, self.authority)
            if len(self._signed) >= self.REMEMBERED:
                self._signed.clear()  # atomic under the GIL, as are get and set: no lock for concurrent callers
            self._signed[token] = cred
        return check(cred, run=run, peer_id=peer_id, role=role, stage=stage, banned=banned, now=now)


def tampered(token: str, **changes) -> str:
    """The same token with some fields changed and the old signature kept (for tests and demos)."""
    cred = replace(decode(token), **changes)
    return f"{_b64(cred.payload())}.{token.split('.')[1]}"


def admin_token(key: Ed25519PrivateKey, run: str, ttl_s: float = 120.0) -> str:
    """A short-lived credential for the operator's own commands (``agoractl auth ...``): role admin, no peer."""
    return issue(key, run=run, node_id="admin", account="operator", role="admin", stage="", peer_id="",
                 ttl_s=ttl_s, serial=0, operator=True)
