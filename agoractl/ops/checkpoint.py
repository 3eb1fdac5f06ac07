"""The checkpoint store: stage checkpoints and replica snapshots under ``checkpoints.store`` (fsspec).

Layout (DESIGN.md §5)::

    <store>/checkpoints/<stage>/step-00000050/model.safetensors      trainable parameters, global names
                                             optimizer.safetensors  optimizer tensors (when given)
                                             optimizer.json         the rest of the optimizer state dict
                                             meta.json              step, stage, manifest hash, time, files
    <store>/checkpoints/<stage>/LATEST                              "step-00000050", written last
    <store>/snapshots/<stage>/step-00000050/<replica>.safetensors   one replica's parameters

A checkpoint is complete once its ``meta.json`` exists: it is written after the tensors and lists
each file's size and sha256, and ``LATEST`` is moved only after that, so a publisher killed at any
point leaves the previous ``LATEST`` in place and loadable. Every object is written whole (local:
temporary name + rename; S3: one PUT). After ``LATEST`` moves, all but the newest
``checkpoints.keep_last`` complete checkpoints are deleted, as are unfinished directories older than
``LATEST`` (debris of killed publishers). S3 endpoint and credentials come from the environment
(:mod:`agoractl.storage`); errors from the store become one line naming the URL (exit 1).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import sys
from typing import TYPE_CHECKING

from agoractl import storage
from agoractl.errors import AgoraError, RuntimeFailure, UsageError
from agoractl.manifest.schema import Run

if TYPE_CHECKING:  # torch and safetensors are imported where tensors are read or written, so that
    import torch   # `checkpoint list` and `fetch` (bytes and JSON only) start without them

    from agoractl.ops.tensor_file import TensorFile

MODEL_FILE = "model.safetensors"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"
META_FILE = "meta.json"
LATEST = "LATEST"
STEP_RE = re.compile(r"^step-(\d{8,})$")
REPLICA_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def due(step: int, every: int) -> bool:
    """Whether a periodic action (publish, snapshot) is due at `step`; `every` 0 means never."""
    return every > 0 and step > 0 and step % every == 0


@dataclass
class Checkpoint:
    """One stage's state at one step, as loaded from the store."""

    model_state: dict[str, torch.Tensor]
    optimizer_state: Optional[dict]
    meta: dict

    def apply_to(self, module: torch.nn.Module, optimizer: Optional[Any] = None) -> int:
        """Load into a stage module (strict: same parameter names) and, when both exist, its
        optimizer (any torch optimizer, such as :func:`agoractl.algorithms.optim.make_optimizer`'s AdamW);
        returns the checkpoint's step (a joining worker's starting point)."""
        try:
            module.load_state_dict(self.model_state, strict=True)
        except RuntimeError as e:
            raise RuntimeFailure(f"checkpoint of stage {self.meta.get('stage')} at step {self.meta.get('step')} "
                                 f"does not fit this stage ({str(e).splitlines()[0][:160]})",
                                 hint="check the manifest: the checkpoint was written by another model") from None
        if optimizer is not None and self.optimizer_state is not None:
            optimizer.load_state_dict(self.optimizer_state)
        return int(self.meta["step"])


class CheckpointStore:
    """Stage checkpoints and replica snapshots in one fsspec location.

    ``CheckpointStore(run)`` takes ``checkpoints.store`` / ``keep_last`` and records the manifest
    hash in every checkpoint; ``CheckpointStore(url, keep_last)`` works without a manifest.
    """

    def __init__(self, run_or_url: Union[Run, str], keep_last: Optional[int] = None):
        if isinstance(run_or_url, Run):
            from agoractl.manifest.loader import manifest_hash

            self.url = run_or_url.checkpoints.store
            self.keep_last = keep_last or run_or_url.checkpoints.keep_last
            self.manifest_hash: Optional[str] = manifest_hash(run_or_url)
        else:
            self.url, self.keep_last, self.manifest_hash = run_or_url, keep_last or 3, None
        if self.keep_last < 1:
            raise UsageError(f"checkpoints.keep_last must be at least 1; got {self.keep_last}")
        self.fs, self.root = storage.filesystem(self.url)
        self.remote = storage.is_remote(self.url)
        self._checked = False

    # ---- paths and errors ------------------------------------------------------------------------

    def _url(self, *parts: str) -> str:
        return storage.join(self.url, *parts)

    def _path(self, *parts: str) -> str:
        return storage.join(self.root, *parts)

    @contextlib.contextmanager
    def _errors(self, url: Optional[str] = None) -> Iterator[None]:
        """Turn storage exceptions into one line naming the URL (exit 1)."""
        try:
            yield
        except AgoraError:
            raise
        except Exception as e:  # fsspec/s3fs/botocore raise many unrelated types
            tensor_file = sys.modules.get("agoractl.ops.tensor_file")  # imported by whoever read tensors
            if tensor_file is not None and isinstance(e, tensor_file.TensorFileError):
                raise RuntimeFailure(str(e), hint="delete the damaged object or publish again") from None
            line = storage.describe_error(url or self.url, e)
            hint = None if "check" in line else "check checkpoints.store and the AWS_* / AGORA_S3_ENDPOINT_URL environment"
            raise RuntimeFailure(line, hint=hint) from e

    def _check(self) -> None:
        """Once per store: a missing bucket, bad credentials or an unreachable endpoint fail here,
        with one clear line, rather than as an empty listing."""
        if self._checked or not self.remote:
            self._checked = True
            return
        bucket = self.root.split("/", 1)[0]
        with self._errors():
            try:
                self.fs.info(bucket)
            except FileNotFoundError:  # HEAD on the bucket says only "Not Found"
                raise RuntimeFailure(f"{self.url}: the bucket does not exist",
                                     hint=f"create bucket {bucket!r}, or point checkpoints.store elsewhere") from None
        self._checked = True

    def _write(self, url: str, data: bytes) -> None:
        self._check()
        with self._errors(url):
            storage.write_bytes_atomic(url, data, fs=self.fs)

    def _read(self, url: str) -> bytes:
        self._check()
        with self._errors(url):
            return self.fs.cat_file(self.fs._strip_protocol(url))

    def _ls(self, *parts: str) -> list[str]:
        """Names directly under a prefix; [] when it does not exist."""
        self._check()
        path = self._path(*parts)
        with self._errors(self._url(*parts)):
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def _exists(self, *parts: str) -> bool:
        self._check()
        path = self._path(*parts)
        with self._errors(self._url(*parts)):
            # Other processes publish too: never answer from a directory listing cached earlier.
            self.fs.invalidate_cache(path.rsplit("/", 1)[0])
            return self.fs.exists(path)

    # ---- checkpoints -----------------------------------------------------------------------------

    def stages(self) -> list[str]:
        """Stages with anything under checkpoints/."""
        return [s for s in self._ls("checkpoints") if not s.startswith(".")]

    def steps(self, stage: str) -> list[int]:
        """Steps of the complete checkpoints of `stage` (meta.json present), ascending."""
        out = []
        for name in self._ls("checkpoints", stage):
            m = STEP_RE.match(name)
            if m and self._exists("checkpoints", stage, name, META_FILE):
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self, stage: str) -> Optional[int]:
        """The step LATEST points to, or None when the stage has no published checkpoint."""
        self._check()
        url = self._url("checkpoints", stage, LATEST)
        with self._errors(url):
            try:
                text = self.fs.cat_file(self._path("checkpoints", stage, LATEST)).decode().strip()
            except FileNotFoundError:
                return None
        m = STEP_RE.match(text)
        if not m:
            raise RuntimeFailure(f"{url}: not a checkpoint pointer ({text[:40]!r})",
                                 hint="publish the stage again; LATEST is rewritten on every publish")
        return int(m.group(1))

    def publish(self, stage: str, step: int, model_state: dict[str, torch.Tensor],
                optimizer_state: Optional[dict] = None, meta: Optional[dict] = None,
                overwrite: bool = False) -> str:
        """Write a checkpoint of `stage` at `step`, then move LATEST to it (if it is the newest) and
        apply retention. Returns the checkpoint's URL. A complete checkpoint already at that step is
        kept (another replica of the stage published first) unless `overwrite`."""
        import safetensors.torch

        from agoractl.ops import optimizer_state as opt_codec

        if step < 0:
            raise UsageError(f"checkpoint step must be non-negative; got {step}")
        self._check()
        directory = self._url("checkpoints", stage, step_dir(step))
        if not overwrite and self._exists("checkpoints", stage, step_dir(step), META_FILE):
            return directory
        files: dict[str, dict[str, Any]] = {}

        def put(name: str, data: bytes) -> None:
            self._write(storage.join(directory, name), data)
            files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

        put(MODEL_FILE, safetensors.torch.save(_contiguous(model_state), metadata={"stage": stage, "step": str(step)}))
        if optimizer_state is not None:
            tensors: dict[str, torch.Tensor] = {}
            tree = opt_codec.encode(optimizer_state, tensors)
            put(OPTIMIZER_TENSORS, safetensors.torch.save(tensors))
            put(OPTIMIZER_JSON, json.dumps(tree, indent=1).encode())
        record = {**(meta or {}), "stage": stage, "step": step, "time": _now(), "files": files}
        if self.manifest_hash and "manifest_hash" not in record:
            record["manifest_hash"] = self.manifest_hash
        # meta.json last within the directory: its presence is what makes the checkpoint complete.
        self._write(storage.join(directory, META_FILE), json.dumps(record, indent=2).encode())
        latest = self.latest_step(stage)
        if latest is None or step >= latest:
            self._write(self._url("checkpoints", stage, LATEST), (step_dir(step) + "\n").encode())
        self.prune(stage)
        return directory

    def prune(self, stage: str) -> list[int]:
        """Delete all but the newest keep_last complete checkpoints, and unfinished directories older
        than LATEST. Returns the steps deleted. Never touches LATEST's target."""
        latest = self.latest_step(stage)
        if latest is None:
            return []
        complete = [s for s in self.steps(stage) if s <= latest]
        keep = set(complete[-self.keep_last:]) | {latest}
        deleted = []
        for name in self._ls("checkpoints", stage):
            m = STEP_RE.match(name)
            if not m:
                continue
            s = int(m.group(1))
            # Unfinished directories newer than LATEST may be a publish in progress: leave them.
            if s in keep or s > latest:
                continue
            with self._errors(self._url("checkpoints", stage, name)):
                self.fs.rm(self._path("checkpoints", stage, name), recursive=True)
            deleted.append(s)
        return deleted

    def meta(self, stage: str, step: int) -> dict:
        url = self._url("checkpoints", stage, step_dir(step), META_FILE)
        if not self._exists("checkpoints", stage, step_dir(step), META_FILE):
            raise RuntimeFailure(f"{url}: no complete checkpoint of stage {stage} at step {step}",
                                 hint="see the published steps with: agoractl checkpoint list FILE")
        return json.loads(self._read(url))

    def resolve(self, stage: str, step: Optional[int]) -> int:
        """`step`, or LATEST's step when None (a clear error when the stage has none)."""
        if step is None:
            step = self.latest_step(stage)
            if step is None:
                raise RuntimeFailure(f"{self._url('checkpoints', stage)}: no published checkpoint of stage {stage}",
                                     hint="publish one with: agoractl checkpoint publish FILE --stage "
                                          f"{stage} --from DIR")
        return step

    def read_files(self, stage: str, step: Optional[int] = None, verify: bool = True) -> tuple[dict, dict[str, bytes]]:
        """meta.json and the raw bytes of every file it lists; with `verify`, each file's size and
        sha256 are checked against meta.json."""
        step = self.resolve(stage, step)
        meta = self.meta(stage, step)
        blobs = {}
        for name, info in meta.get("files", {}).items():
            url = self._url("checkpoints", stage, step_dir(step), name)
            data = self._read(url)
            if verify and (len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]):
                raise RuntimeFailure(f"{url}: does not match its meta.json (size or sha256)",
                                     hint="the checkpoint is damaged; fetch an older step with --step")
            blobs[name] = data
        return meta, blobs

    def load(self, stage: str, step: Optional[int] = None, verify: bool = True) -> Checkpoint:
        """The checkpoint of `stage` at `step` (None = LATEST), verified against its meta.json."""
        import safetensors.torch

        from agoractl.ops import optimizer_state as opt_codec

        step = self.resolve(stage, step)
        meta, blobs = self.read_files(stage, step, verify)
        if MODEL_FILE not in blobs:
            raise RuntimeFailure(f"{self._url('checkpoints', stage, step_dir(step))}: meta.json lists no {MODEL_FILE}")
        model_state = safetensors.torch.load(blobs[MODEL_FILE])
        opt = None
        if OPTIMIZER_JSON in blobs:
            tensors = safetensors.torch.load(blobs[OPTIMIZER_TENSORS]) if OPTIMIZER_TENSORS in blobs else {}
            opt = opt_codec.decode(json.loads(blobs[OPTIMIZER_JSON]), tensors)
        return Checkpoint(model_state, opt, meta)

    def list(self) -> list[dict]:
        """Every complete checkpoint: stage, step, latest (bool), time, bytes, manifest_hash, url."""
        rows = []
        for stage in self.stages():
            latest = self.latest_step(stage)
            for step in self.steps(stage):
                meta = self.meta(stage, step)
                rows.append({"stage": stage, "step": step, "latest": step == latest, "time": meta.get("time"),
                             "bytes": sum(f["bytes"] for f in meta.get("files", {}).values()),
                             "optimizer": OPTIMIZER_JSON in meta.get("files", {}),
                             "manifest_hash": meta.get("manifest_hash"),
                             "url": self._url("checkpoints", stage, step_dir(step))})
        return rows

    # ---- replica snapshots -----------------------------------------------------------------------

    def save_snapshot(self, stage: str, step: int, replica: str, state: dict[str, torch.Tensor],
                      meta: Optional[dict[str, Any]] = None) -> str:
        """Write one replica's parameters at `step` (whole object, atomic). Returns its URL.

        `meta`: extra facts stored (as strings) in the safetensors header; analysis reads
        ``last_averaged_segment`` (the SPARTA segment of the last round this replica applied)."""
        import safetensors.torch

        if not REPLICA_RE.match(replica):
            raise UsageError(f"replica name {replica!r}: use letters, digits, '.', '_' or '-' (at most 128)")
        self._check()
        url = self._url("snapshots", stage, step_dir(step), f"{replica}.safetensors")
        meta = {**{k: str(v) for k, v in (meta or {}).items()},
                "stage": stage, "step": str(step), "replica": replica, "time": _now()}
        if self.manifest_hash:
            meta["manifest_hash"] = self.manifest_hash
        self._write(url, safetensors.torch.save(_contiguous(state), metadata=meta))
        return url

    def snapshot_stages(self) -> list[str]:
        return [s for s in self._ls("snapshots") if not s.startswith(".")]

    def snapshot_steps(self, stage: str) -> list[int]:
        """Steps at which `stage` has at least one replica snapshot, ascending."""
        return sorted(int(m.group(1)) for m in map(STEP_RE.match, self._ls("snapshots", stage)) if m)

    def snapshot_replicas(self, stage: str, step: int) -> list[str]:
        """Replica names with a snapshot of `stage` at `step` (temporary files are ignored)."""
        return [n[: -len(".safetensors")] for n in self._ls("snapshots", stage, step_dir(step))
                if n.endswith(".safetensors") and not n.startswith(".")]

    def snapshot_url(self, stage: str, step: int, replica: str) -> str:
        return self._url("snapshots", stage, step_dir(step), f"{replica}.safetensors")

    def open_snapshot(self, stage: str, step: int, replica: str) -> TensorFile:
        """One replica's snapshot opened for ranged reads (close it, or use it as a context manager)."""
        from agoractl.ops.tensor_file import TensorFile

        url = self.snapshot_url(stage, step, replica)
        with self._errors(url):
            return TensorFile(self.fs, self.fs._strip_protocol(url))

    def iter_snapshot(self, stage: str, step: int) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """(replica, parameters) for every replica of `stage` at `step`, one at a time."""
        import safetensors.torch

        for replica in self.snapshot_replicas(stage, step):
            yield replica, safetensors.torch.load(self._read(self.snapshot_url(stage, step, replica)))


def _contiguous(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, non-aliasing copies (safetensors refuses shared or strided storage)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
