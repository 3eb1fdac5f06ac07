"""Object storage through fsspec: local paths, ``file://`` and ``s3://`` (s3fs), plus atomic writes.

The S3 endpoint and credentials come from the environment, never from a manifest: the standard
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_DEFAULT_REGION`` and, for a non-AWS
endpoint (a loopback ``moto_server``, MinIO, ...), ``AGORA_S3_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL``).

Writes are atomic in the sense that matters for a crash: a local file is written to a temporary
name in the same directory and renamed; a remote object is uploaded whole (S3 never shows a partial
object). Indexes and pointers are written last by their callers.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import fsspec

from agoractl.errors import RuntimeFailure


def storage_options(url: str) -> dict[str, Any]:
    """fsspec options for `url`, from the environment."""
    if url.startswith("s3://"):
        endpoint = os.environ.get("AGORA_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
        opts: dict[str, Any] = {"skip_instance_cache": True}
        if endpoint:
            opts["client_kwargs"] = {"endpoint_url": endpoint}
        return opts
    return {}


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for `url` and the path within it (local paths are made absolute)."""
    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options(url))
    except (ImportError, ValueError) as e:
        raise RuntimeFailure(f"{url}: unsupported storage URL ({e})", hint="use a local path, file:// or s3://")
    return fs, path


def join(base: str, *parts: str) -> str:
    """Join URL/path parts with '/', keeping the scheme of `base`."""
    out = base.rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def write_bytes_atomic(url: str, data: bytes, fs: fsspec.AbstractFileSystem | None = None) -> None:
    """Write `data` to `url` so that readers see either nothing or the whole object.

    `fs`: an already open filesystem for `url` (saves a new S3 session per object)."""
    if fs is None:
        fs, path = filesystem(url)
    else:
        path = fs._strip_protocol(url)
    if is_remote(url):
        fs.pipe_file(path, data)
        return
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def describe_error(url: str, exc: BaseException) -> str:
    """One line naming the URL and what went wrong, for errors from fsspec/s3fs/botocore."""
    name = type(exc).__name__
    text = str(exc).splitlines()[0] if str(exc) else name
    # Credentials first: "The AWS Access Key Id you provided does not exist" is not a missing bucket.
    if any(s in text for s in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden",
                               "NoCredentialsError", "Unable to locate credentials", "Access Key Id",
                               "signature we calculated")) or name == "NoCredentialsError" or (
                                   name == "PermissionError" and url.startswith("s3://")):
        return f"{url}: access denied: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
    if "NoSuchBucket" in text or ("does not exist" in text.lower() and url.startswith("s3://")):
        return f"{url}: the bucket does not exist"
    if "Could not connect" in text or "Connect" in name or "EndpointConnectionError" in name:
        return f"{url}: cannot reach the store ({text}); check AGORA_S3_ENDPOINT_URL"
    return f"{url}: {name}: {text}"
