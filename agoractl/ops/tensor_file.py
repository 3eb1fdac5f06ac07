"""Reading a safetensors file a slice at a time, through fsspec (local files or ``s3://`` objects).

``safetensors.torch.load`` needs the whole file in memory; divergence analysis reads the same
element range of one tensor from every replica's snapshot side by side, so it parses the header
itself (8-byte little-endian length, JSON header, then the raw little-endian data) and reads byte
ranges. Remote reads go through fsspec's buffered file (ranged GETs).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Optional

import fsspec
import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER = 100 * 2**20
"""The safetensors format caps the JSON header at 100 MB; anything larger is not a safetensors file."""


class TensorFileError(ValueError):
    """The file is not a readable safetensors file (truncated, corrupt, unsupported dtype)."""


@dataclass(frozen=True)
class Entry:
    """One tensor in the file: dtype, shape and its byte range within the data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


class TensorFile:
    """An open safetensors file: ``entries`` (in file order), ``metadata``, and ranged reads."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, block_size: Optional[int] = None):
        self.path = path
        kwargs = {"block_size": block_size} if block_size else {}
        self._f = fs.open(path, "rb", **kwargs)
        try:
            self.size = fs.size(path)
            self.entries, self.metadata, self._data_start = self._read_header()
        except Exception:
            self._f.close()
            raise

    def _read_header(self) -> tuple[dict[str, Entry], dict[str, str], int]:
        head = self._f.read(8)
        if len(head) != 8:
            raise TensorFileError(f"{self.path}: truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > self.size:
            raise TensorFileError(f"{self.path}: not a safetensors file (header length {n})")
        try:
            header: dict[str, Any] = json.loads(self._f.read(n))
        except ValueError as e:
            raise TensorFileError(f"{self.path}: corrupt safetensors header ({e})") from None
        metadata = header.pop("__metadata__", None) or {}
        entries = {}
        for name, spec in header.items():
            if spec["dtype"] not in DTYPES:
                raise TensorFileError(f"{self.path}: tensor {name} has unsupported dtype {spec['dtype']}")
            b, e = spec["data_offsets"]
            entries[name] = Entry(DTYPES[spec["dtype"]], tuple(spec["shape"]), b, e)
        start = 8 + n
        for name, e in entries.items():
            if start + e.end > self.size or e.end - e.begin != e.numel * e.itemsize:
                raise TensorFileError(f"{self.path}: truncated or corrupt at tensor {name}")
        order = sorted(entries, key=lambda k: entries[k].begin)
        return {k: entries[k] for k in order}, metadata, start

    @property
    def data_bytes(self) -> int:
        return self.size - self._data_start

    def read(self, name: str, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """Elements [lo, hi) of tensor `name`, flattened, in its stored dtype."""
        e = self.entries[name]
        hi = e.numel if hi is None else hi
        if not 0 <= lo <= hi <= e.numel:
            raise IndexError(f"{self.path}: range {lo}:{hi} outside tensor {name} of {e.numel} elements")
        size = e.itemsize
        nbytes = (hi - lo) * size
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self._f.seek(self._data_start + e.begin + lo * size)
        got = self._f.readinto(buf.numpy()) if nbytes else 0
        if got != nbytes:
            raise TensorFileError(f"{self.path}: truncated while reading tensor {name}")
        return buf.view(e.dtype)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
