"""Spill files of re-sharding's deal pass, under a work URL: a local directory or a prefix in the store.

A unit's spill is the concatenation of one Arrow IPC *stream* per shard (the unit's documents dealt to
that shard, with their sort key); its JSON marker records each shard's ``[offset, length]`` in the
file and the file's size. The write pass of shard k then reads exactly its piece of every unit: a
slice of a memory map when the work URL is local, one ranged GET when it is in the store (so any
machine of a cluster can read any unit, and no spill lives on one machine's disk). A spill is
uploaded whole (S3 shows an object only once complete) or renamed into place, before its marker, and
a marker is believed only when the spill it names has the recorded size.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from agoractl import storage
from agoractl.data import remote

SPILL_FORMAT = 2
"""Bumped when the spill layout changes: markers of another layout are redone, not misread."""


def unit_urls(work: str, u: int) -> tuple[str, str]:
    """The spill and the marker of unit u."""
    return (storage.join(work, "units", f"unit-{u:06d}.arrow"), storage.join(work, "units", f"unit-{u:06d}.json"))


def read_json(url: str) -> Optional[dict[str, Any]]:
    """A small JSON object at `url`, or None when it is absent or unreadable (then it is redone)."""
    try:
        return json.loads(remote.read_bytes(url))
    except (OSError, ValueError):
        return None


def write_json(url: str, body: dict[str, Any]) -> None:
    remote.write_bytes(url, json.dumps(body).encode(), durable=False)


def size_of(url: str) -> Optional[int]:
    fs, path = remote.filesystem(url)
    try:
        return int(fs.size(path)) if storage.is_remote(url) else os.path.getsize(path)
    except (OSError, FileNotFoundError):
        return None


def finished(work: str, u: int, fingerprint: str) -> Optional[dict[str, Any]]:
    """Unit u's marker when it belongs to this configuration and its spill is whole; else None."""
    spill, marker = unit_urls(work, u)
    body = read_json(marker)
    if not body or body.get("fingerprint") != fingerprint or body.get("spill_format") != SPILL_FORMAT:
        return None
    return body if size_of(spill) == body.get("spill_bytes") else None


class _Sink:
    """Where a spill is written: a temporary local file renamed into place, or a streamed upload."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.path = remote.filesystem(url)
        if storage.is_remote(url):
            self.tmp = None
            self.file = self.fs.open(self.path, "wb")  # multipart upload: visible only when closed
        else:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.tmp = f"{self.path}.{uuid.uuid4().hex[:8]}.tmp"
            self.file = open(self.tmp, "wb")

    def commit(self) -> None:
        self.file.close()
        if self.tmp is not None:
            os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self.tmp is not None:
            self.file.close()
            if os.path.exists(self.tmp):
                os.remove(self.tmp)
        else:
            self.file.discard()  # the multipart upload is dropped: no object appears


def write_unit(work: str, u: int, table: pa.Table, shard: np.ndarray) -> tuple[dict[str, list[int]], int]:
    """Spill `table` (rows grouped by `shard`, ascending) as one IPC stream per shard.

    Returns ``{shard: [offset, length]}`` and the spill's size in bytes.
    """
    present, starts, counts = np.unique(shard, return_index=True, return_counts=True)
    spans: dict[str, list[int]] = {}
    sink = _Sink(unit_urls(work, u)[0])
    offset = 0
    try:
        for s, start, count in zip(present.tolist(), starts.tolist(), counts.tolist()):
            buf = pa.BufferOutputStream()
            with pa.ipc.new_stream(buf, table.schema) as writer:
                writer.write_table(table.slice(start, count))
            data = buf.getvalue()
            sink.file.write(memoryview(data))
            spans[str(s)] = [offset, data.size]
            offset += data.size
    except BaseException:
        sink.abort()
        raise
    sink.commit()
    return spans, offset


def read_piece(work: str, u: int, offset: int, length: int) -> pa.Table:
    """Shard k's piece of unit u: a slice of a memory map locally, one ranged GET from a store."""
    url = unit_urls(work, u)[0]
    fs, path = remote.filesystem(url)
    if storage.is_remote(url):
        data = pa.py_buffer(fs.cat_file(path, start=offset, end=offset + length))
    else:
        # A zero-copy view: the mapping stays alive as long as the piece's buffers are referenced.
        data = pa.memory_map(path, "r").read_at(length, offset)
    return pa.ipc.open_stream(data).read_all()


def clear(work: str) -> None:
    """Remove the work directory or prefix and everything under it."""
    if storage.is_remote(work):
        remote.remove(work, recursive=True)
    else:
        shutil.rmtree(remote.filesystem(work)[1], ignore_errors=True)
