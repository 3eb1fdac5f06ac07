"""Filesystems for the data path, reused within a process, and whole-object reads of small files.

Making an s3fs filesystem builds a botocore client (a noticeable fraction of a second), and the
data path touches many objects: one filesystem per process and store is reused here (keyed by the
process id and the S3 environment, so a forked worker or a changed endpoint gets a fresh one).
Small mutable objects (index, ledger, progress reports, markers) are read with one GET of the whole
object, never through a cached listing, so a reader always sees the latest complete version.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from agoractl import storage

_ENV = ("AGORA_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "HF_TOKEN", "HF_ENDPOINT")
_CACHE: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def filesystem(url: str) -> tuple[Any, str]:
    """Like :func:`agoractl.storage.filesystem`, reusing one remote filesystem per process and store (made
    once under a lock: threads starting together share it rather than each building a client)."""
    if not storage.is_remote(url):
        return storage.filesystem(url)
    key = (os.getpid(), url.split("://", 1)[0], tuple(os.environ.get(k) for k in _ENV))
    with _LOCK:
        fs = _CACHE.get(key)
        if fs is None:
            fs, path = storage.filesystem(url)
            _CACHE[key] = fs
            return fs, path
    return fs, fs._strip_protocol(url)


def read_bytes(url: str) -> bytes:
    """The whole object at `url` (FileNotFoundError when absent)."""
    fs, path = filesystem(url)
    if storage.is_remote(url):
        return fs.cat_file(path)
    with open(path, "rb") as f:
        return f.read()


def listing(url: str) -> dict[str, int]:
    """Names and sizes of the objects directly under `url` (one LIST request on a store)."""
    fs, path = filesystem(url)
    if storage.is_remote(url):
        fs.invalidate_cache(path)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return {}
    return {os.path.basename(e["name"].rstrip("/")): int(e.get("size") or 0) for e in entries
            if e.get("type") != "directory"}


def write_bytes(url: str, data: bytes, durable: bool = True) -> None:
    """Atomic write (temporary name and rename locally; one whole PUT on a store).

    `durable=False` skips the fsync for markers that are checked against what they describe
    before they are trusted (a marker torn by a power cut is ignored, not believed).
    """
    if storage.is_remote(url):
        fs, path = filesystem(url)
        fs.pipe_file(path, data)
    elif durable:
        storage.write_bytes_atomic(url, data)
    else:
        path = filesystem(url)[1]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)


def remove(url: str, recursive: bool = False) -> None:
    fs, path = filesystem(url)
    try:
        fs.rm(path, recursive=recursive)
    except FileNotFoundError:
        pass
