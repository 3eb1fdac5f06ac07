"""The authority's Ed25519 key pair: made by ``agoractl auth keygen``, read from ``AGORA_AUTHORITY_KEY``.

The private key is a PKCS#8 PEM file (mode 0600, written to a temporary name and renamed, so a half-written
key never exists under the real name); the public key is one line of url-safe base64 (the raw 32 bytes),
short enough to paste into a manifest's ``admission.authority_public_key``.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agoractl.errors import RuntimeFailure, UsageError

KEY_ENV = "AGORA_AUTHORITY_KEY"


def generate() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The public key as one line of url-safe base64 (no padding)."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def key_id(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """A short fingerprint of the public key (16 hex digits): names the authority inside a credential."""
    return hashlib.sha256(public_text(key).encode()).hexdigest()[:16]


def parse_public(text: str) -> Ed25519PublicKey:
    """The public key from its one-line text; UsageError when it is not 32 bytes of url-safe base64."""
    try:
        raw = base64.urlsafe_b64decode(text.strip() + "=" * (-len(text.strip()) % 4))
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, UnsupportedAlgorithm):
        raise UsageError(f"authority public key {text[:20]!r}...: not an Ed25519 public key",
                         hint="copy the one line that `agoractl auth keygen` prints (or its .pub file)") from None


def write_pair(path: Path, force: bool = False) -> tuple[Path, Path, Ed25519PrivateKey]:
    """Write a fresh private key to PATH (0600) and its public key to PATH.pub; refuses to overwrite."""
    pub_path = path.with_name(path.name + ".pub")
    if not force and (path.exists() or pub_path.exists()):
        raise UsageError(f"{path}: a key already exists there", hint="pick another path or pass --force")
    key = generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, data, mode in ((path, pem, 0o600), (pub_path, (public_text(key) + "\n").encode(), 0o644)):
        tmp = target.with_name(target.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    return path, pub_path, key


def load_private(path: str | Path | None = None) -> Ed25519PrivateKey:
    """The private key at PATH (default: $AGORA_AUTHORITY_KEY); one-line errors naming the fix."""
    path = path or os.environ.get(KEY_ENV)
    if not path:
        raise UsageError(f"{KEY_ENV} is not set: the authority's private key is needed",
                         hint=f"run `agoractl auth keygen KEYFILE` and export {KEY_ENV}=KEYFILE")
    p = Path(path)
    try:
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except FileNotFoundError:
        raise UsageError(f"{KEY_ENV}={p}: no such file", hint="run `agoractl auth keygen` to make one") from None
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise RuntimeFailure(f"{p}: not a PEM private key ({e})",
                             hint="point AGORA_AUTHORITY_KEY at the file `agoractl auth keygen` wrote") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise RuntimeFailure(f"{p}: not an Ed25519 key", hint="make one with `agoractl auth keygen`")
    return key
