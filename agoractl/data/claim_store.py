"""Small JSON objects with atomic create and compare-and-swap, on a local directory or S3: what the
shard ledger's claims (:mod:`agoractl.data.claims`) are built on.

Two operations are all the claim protocol needs, and each store offers them natively:

- **create** (only if absent): on S3 a ``PutObject`` with ``If-None-Match: *`` (conditional writes,
  S3 since 2024; MinIO, Ceph RGW and moto_server accept it too); locally the object is written whole
  to a temporary name and hard-linked to its name (``link`` fails when the name exists, like
  ``O_EXCL``), so a reader never sees a partial object.
- **replace** (only if unchanged since read): on S3 a ``PutObject`` with ``If-Match: <ETag>``; locally
  an exclusive ``flock`` on a sidecar ``.lock`` file around read-compare-rename (the kernel drops the
  lock when its holder dies, so a killed trainer never leaves a stale lock). The tag of a local object
  is a hash of its bytes.

Either returns ``None`` when another writer got there first; the caller decides what to do. Reads are
one GET of the whole object (body and ETag from the same response).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import uuid
from typing import Optional, Protocol

from agoractl import storage
from agoractl.data import remote
from agoractl.errors import RuntimeFailure


class ClaimStore(Protocol):
    def read(self, name: str) -> Optional[tuple[bytes, str]]: ...

    def create(self, name: str, data: bytes) -> Optional[str]: ...

    def replace(self, name: str, data: bytes, tag: str) -> Optional[str]: ...

    def names(self, prefix: str) -> list[str]: ...


def _tag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


class LocalClaimStore:
    """Objects as files under a directory (one host, or a shared filesystem with working flock)."""

    def __init__(self, root: str):
        self.root = storage.filesystem(root)[1]
        self.url = root

    def _path(self, name: str) -> str:
        return os.path.join(self.root, *name.split("/"))

    def read(self, name: str) -> Optional[tuple[bytes, str]]:
        try:
            with open(self._path(name), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return data, _tag(data)

    def _temp(self, path: str, data: bytes) -> str:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def create(self, name: str, data: bytes) -> Optional[str]:
        path = self._path(name)
        tmp = self._temp(path, data)
        try:
            os.link(tmp, path)  # atomic, and fails if the name exists: O_EXCL for a whole file
        except FileExistsError:
            return None
        finally:
            os.unlink(tmp)
        return _tag(data)

    def replace(self, name: str, data: bytes, tag: str) -> Optional[str]:
        path = self._path(name)
        with open(path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                current = self.read(name)
                if current is None or current[1] != tag:
                    return None
                os.replace(self._temp(path, data), path)
                return _tag(data)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def names(self, prefix: str) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self._path(prefix))
                          if n.endswith(".json") and not n.endswith(".tmp"))
        except FileNotFoundError:
            return []


class S3ClaimStore:
    """Objects under an ``s3://bucket/prefix``; atomicity from S3's conditional writes."""

    def __init__(self, root: str):
        self.url = root
        self.fs, path = remote.filesystem(root)
        self.bucket, _, self.prefix = path.partition("/")

    def _key(self, name: str) -> str:
        return f"{self.prefix.rstrip('/')}/{name}" if self.prefix else name

    def read(self, name: str) -> Optional[tuple[bytes, str]]:
        from fsspec.asyn import sync

        async def get():
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self._key(name))
            async with resp["Body"] as body:
                return await body.read(), resp["ETag"].strip('"')

        try:
            return sync(self.fs.loop, get)
        except FileNotFoundError:
            return None

    def _put(self, name: str, data: bytes, **condition) -> Optional[str]:
        try:
            out = self.fs.call_s3("put_object", Bucket=self.bucket, Key=self._key(name), Body=data, **condition)
        except FileExistsError:  # s3fs's translation of a failed If-None-Match
            return None
        except OSError as e:
            if _precondition_failed(e):
                return None
            raise
        return out["ETag"].strip('"')

    def create(self, name: str, data: bytes) -> Optional[str]:
        return self._put(name, data, IfNoneMatch="*")

    def replace(self, name: str, data: bytes, tag: str) -> Optional[str]:
        return self._put(name, data, IfMatch=f'"{tag}"')

    def names(self, prefix: str) -> list[str]:
        return sorted(n for n in remote.listing(storage.join(self.url, prefix)) if n.endswith(".json"))


def _precondition_failed(e: BaseException) -> bool:
    """412 (the condition failed), 409 (S3's ConditionalRequestConflict: a concurrent conditional write
    won), or a key that vanished under If-Match."""
    cause = e.__cause__ or e
    code = (getattr(cause, "response", None) or {}).get("Error", {}).get("Code", "")
    text = f"{code} {e}"
    return any(k in text for k in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")) or \
        isinstance(e, FileNotFoundError) or getattr(e, "errno", None) == errno.ENOENT


def claim_store(root: str) -> ClaimStore:
    """The store for `root` (a local path, ``file://`` or ``s3://``)."""
    if root.startswith("s3://"):
        return S3ClaimStore(root)
    if storage.is_remote(root):
        raise RuntimeFailure(f"{root}: the shard ledger needs a local path or s3:// (atomic claims)",
                             hint="set data.output to a local path or an s3:// URL")
    return LocalClaimStore(root)
