"""A node's own Ed25519 identity key: it signs the node's trainer reports (owner-signed records, read by the
Health Monitor) and names the node in metrics (the ``instance`` label), stable across restarts.

The key lives at ``AGORA_NODE_KEY`` (a PKCS#8 PEM file, made on first use, mode 0600, written to a temporary
name and renamed); without it a node makes a fresh key each start (and so a new ``instance``).
``launch swarm`` gives every node slot its own key file under the run directory, so a restarted worker keeps
its ``instance``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agoractl.auth.keys import parse_public, public_text

NODE_KEY_ENV = "AGORA_NODE_KEY"


def load_or_create(path: Optional[str | Path] = None) -> Ed25519PrivateKey:
    """The key at PATH (default $AGORA_NODE_KEY), made there when absent; a fresh in-memory key with neither."""
    path = path or os.environ.get(NODE_KEY_ENV)
    if not path:
        return Ed25519PrivateKey.generate()
    p = Path(path)
    if p.exists():
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{p}: not an Ed25519 key")
        return key
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.replace(tmp, p)
    return key


def instance_id(key: Ed25519PrivateKey) -> str:
    """The node's ``instance`` label: 16 hex digits of SHA-256 over its public key."""
    return hashlib.sha256(public_text(key).encode()).hexdigest()[:16]


def _payload(fields: dict) -> bytes:
    body = {k: v for k, v in fields.items() if k != "sig"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def sign(key: Ed25519PrivateKey, fields: dict) -> dict:
    """FIELDS with ``key`` (the public key text) and ``sig`` (base64url Ed25519 over the canonical JSON of every
    other field) set."""
    out = dict(fields, key=public_text(key))
    out["sig"] = base64.urlsafe_b64encode(key.sign(_payload(out))).decode().rstrip("=")
    return out


def verify(fields: dict) -> bool:
    """True when ``sig`` is the signature of ``key`` over the other fields (False for unsigned or tampered)."""
    try:
        sig, key = fields.get("sig"), fields.get("key")
        if not sig or not key:
            return False
        raw = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
        parse_public(key).verify(raw, _payload(fields))
        return True
    except (InvalidSignature, Exception):  # a malformed key or signature is an unverified report too
        return False
