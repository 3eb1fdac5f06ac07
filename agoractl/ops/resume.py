"""Resuming a run from its checkpoint store, and the store's binding to one run (report §3.3.1.1, §3.7).

A store belongs to the run that first wrote to it: ``<store>/RUN.json`` records the run's identity,
its name and a hash of the manifest fields that change the model or the order of the data
(:data:`IDENTITY_FIELDS`; not ``max_steps``, so a run can be extended). Every launch plans from the
store before it trains (:func:`plan`):

- an empty store (no checkpoint): start at step 0 and bind the store to this run;
- this run's checkpoints: resume from the newest step complete for **every** stage (a stage
  whose publisher was killed mid-write falls back with the others), or ``--resume-step N``;
- checkpoint directories past the resumed step (complete for some stages only, or half-written by a
  killed publisher: the abandoned trajectory) are moved aside too, so the resumed run writes its own;
- another run's checkpoints, or this run's at or beyond ``training.max_steps`` (or the launch's
  ``training.until_step``): refused with one line saying what is there and how to proceed (exit 2);
- ``--fresh`` starts over: in an empty store, or with ``--force``, which moves the old checkpoints,
  snapshots and RUN.json aside under ``<store>/aside/<UTC time>/`` (never deletes them);
- ``--force`` alone resumes from a store whose identity differs or is missing (loading still checks
  every tensor); RUN.json keeps its owner, so every later launch on it needs ``--force`` too.

:func:`decide` is the pure part (what to do, given what the store holds); :func:`plan` reads the
store, checks that the chosen checkpoint's files are all there, and moves aside / binds.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Sequence

from agoractl import storage
from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.schema import Run
from agoractl.ops.checkpoint import LATEST, STEP_RE, CheckpointStore, step_dir

IDENTITY_FILE = "RUN.json"
ASIDE_DIR = "aside"
CENTRAL_DIR = "central"
"""The centralized reference keeps its own checkpoints under ``<store>/central/`` (one stage, ``model``)."""
CENTRAL_STAGE = "model"
IDENTITY_FIELDS = ("metadata.name", "model", "stages", "tokenizer", "data.source", "data.text_column",
                   "data.num_shards", "data.seed", "training.global_batch_size", "training.seed",
                   "trainers.count", "trainers.shards_per_trainer", "data_parallel.method")
"""Manifest fields whose change makes a different run: the model, the data and its order."""


def identity(run: Run) -> dict[str, Any]:
    """This run's identity: name and a short hash of :data:`IDENTITY_FIELDS`."""
    dumped = run.model_dump(mode="json")
    values = {}
    for path in IDENTITY_FIELDS:
        node: Any = dumped
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        values[path] = node
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]
    return {"name": run.metadata.name, "hash": digest}


@dataclass
class ResumePlan:
    """What a launch does with its store."""

    step: int
    """The step to start at: 0 from scratch, else the checkpoint step to load."""
    action: str
    """``new`` (empty store), ``resume``, ``start-over`` (old checkpoints moved aside)."""
    store: str
    stages: dict[str, list[int]] = field(default_factory=dict)
    """Complete checkpoint steps per stage, as found."""
    moved_aside: Optional[str] = None
    forced: bool = False
    identity: dict[str, Any] = field(default_factory=dict)
    binding: Optional[str] = None
    """When the store was bound to this run (RUN.json's ``bound``): names this run's other artefacts."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        if self.action == "resume":
            later = f"; later, incomplete steps moved to {self.moved_aside}" if self.moved_aside else ""
            return f"resuming from step {self.step} (checkpoints in {self.store}){later}"
        if self.action == "start-over":
            return f"starting over at step 0; the old checkpoints are under {self.moved_aside}"
        return f"starting at step 0 (no checkpoint in {self.store})"


def _steps_text(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps[-5:])) if steps else "none"


def decide(here: Mapping[str, Any], there: Optional[Mapping[str, Any]], complete: Mapping[str, Sequence[int]],
           stages: Sequence[str], max_steps: int, url: str, resume_step: Optional[int] = None,
           fresh: bool = False, force: bool = False, until: Optional[int] = None) -> tuple[int, str]:
    """(step, action) for a launch, from this run's identity `here`, the store's `there` (None when
    unbound) and its complete checkpoint steps per stage (`until`: the launch's training.until_step). Raises
    the one-line refusals."""
    found = {s: sorted(complete.get(s, [])) for s in stages}
    latest_any = max([0, *(max(v) for v in found.values() if v)])
    owner = f"run {there['name']}" if there else "an unrecorded run"
    if fresh:
        if latest_any == 0 or force:
            return 0, "start-over" if latest_any else "new"
        raise UsageError(f"{url} holds checkpoints of {owner} up to step {latest_any}; --fresh starts over only "
                         "in an empty store", hint="add --force to move them aside (under aside/), or point "
                                                   "checkpoints.store elsewhere")
    if not force:
        if there is not None and (there.get("name"), there.get("hash")) != (here["name"], here["hash"]):
            raise UsageError(f"{url} belongs to run {there.get('name')} (identity {there.get('hash')}), not to "
                             f"this manifest's run {here['name']} ({here['hash']}); its checkpoints reach step "
                             f"{latest_any}", hint="point checkpoints.store elsewhere, resume with that run's "
                                                   "manifest, or pass --fresh --force to move them aside")
        if there is None and latest_any:
            raise UsageError(f"{url} holds checkpoints (up to step {latest_any}) that record no run identity",
                             hint="pass --force to resume from them as this run's, or --fresh --force to move "
                                  "them aside")
    common = sorted(set.intersection(*(set(v) for v in found.values()))) if found else []
    if resume_step is not None:
        if resume_step > max_steps:
            raise UsageError(f"--resume-step {resume_step} is beyond training.max_steps ({max_steps})",
                             hint="raise training.max_steps with --set training.max_steps=N")
        if resume_step in common:
            return resume_step, "resume"
        partial = [s for s, v in found.items() if resume_step in v]
        if partial:
            missing = [s for s in stages if s not in partial]
            raise RuntimeFailure(f"{url}: the checkpoint at step {resume_step} is incomplete: stage(s) "
                                 f"{', '.join(missing)} have none", hint=f"resume from a complete step "
                                                                         f"({_steps_text(common)})")
        raise UsageError(f"--resume-step {resume_step}: {url} holds no checkpoint at that step; complete steps: "
                         f"{_steps_text(common)}", hint="choose one of those, or omit --resume-step for the latest")
    if latest_any == 0:
        return 0, "new"
    if not common:
        have = "; ".join(f"{s}: {_steps_text(v)}" for s, v in found.items())
        raise RuntimeFailure(f"{url}: no checkpoint step is complete for every stage ({have})",
                             hint="pass --fresh --force to move them aside and start over")
    latest = common[-1]
    if latest >= max_steps:
        done = "is already complete" if latest == max_steps else "went beyond training.max_steps"
        raise UsageError(f"run {here['name']} {done}: {url} holds its checkpoints up to step {latest} "
                         f"(training.max_steps is {max_steps})",
                         hint="raise training.max_steps to train further, or pass --fresh --force to start over")
    if until is not None and latest >= until:
        raise UsageError(f"run {here['name']} already reached step {latest} ({url}); this launch stops after step "
                         f"{until} (--until-step / training.until_step)",
                         hint="raise --until-step, or drop it to train to training.max_steps")
    return latest, "resume"


# -- the store ------------------------------------------------------------------------------------

def read_identity(store: CheckpointStore) -> Optional[dict[str, Any]]:
    if not store._exists(IDENTITY_FILE):
        return None
    url = store._url(IDENTITY_FILE)
    try:
        return json.loads(store._read(url))
    except ValueError:
        raise RuntimeFailure(f"{url}: not a run identity file", hint="delete it, or pass --force") from None


def bind(store: CheckpointStore, here: Mapping[str, Any]) -> dict:
    """Record this run as the store's owner."""
    body = {**here, "fields": list(IDENTITY_FIELDS),
            "bound": dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds")}
    store._write(store._url(IDENTITY_FILE), (json.dumps(body, indent=2) + "\n").encode())
    return body


def move_aside(store: CheckpointStore) -> str:
    """Move checkpoints/, snapshots/ and RUN.json under aside/<UTC time>/; returns that prefix's URL."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    dest = storage.join(store.root, ASIDE_DIR, stamp)
    with store._errors(store._url(ASIDE_DIR, stamp)):
        for name in ("checkpoints", "snapshots", IDENTITY_FILE):
            src = storage.join(store.root, name)
            if store.fs.exists(src):
                store.fs.makedirs(dest, exist_ok=True)
                store.fs.mv(src, storage.join(dest, name), recursive=True)
        store.fs.invalidate_cache()
    return store._url(ASIDE_DIR, stamp)


def set_aside_later(store: CheckpointStore, stages: Sequence[str], step: int) -> Optional[str]:
    """Move every checkpoint directory of `stages` past `step` (complete or not: the abandoned trajectory
    of a run resumed from `step`) under aside/<UTC time>/ and point LATEST at `step`; returns the
    prefix's URL, or None when there was nothing to move. The resumed run then publishes those steps
    afresh (a publisher keeps a complete checkpoint it finds at its step)."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    moved = False
    for stage in stages:
        later = [n for n in store._ls("checkpoints", stage) if STEP_RE.match(n) and int(n[5:]) > step]
        for name in later:
            dest = storage.join(store.root, ASIDE_DIR, stamp, "checkpoints", stage)
            with store._errors(store._url("checkpoints", stage, name)):
                store.fs.makedirs(dest, exist_ok=True)
                store.fs.mv(storage.join(store.root, "checkpoints", stage, name), storage.join(dest, name),
                            recursive=True)
            moved = True
        if later:
            store._write(store._url("checkpoints", stage, LATEST), (step_dir(step) + "\n").encode())
    if moved:
        store.fs.invalidate_cache()
    return store._url(ASIDE_DIR, stamp) if moved else None


def check_files(store: CheckpointStore, stage: str, step: int) -> None:
    """Every file the checkpoint's meta.json lists is present with its recorded size (exit 1 if not)."""
    meta = store.meta(stage, step)
    for name, info in meta.get("files", {}).items():
        path = storage.join(store.root, "checkpoints", stage, step_dir(step), name)
        url = store._url("checkpoints", stage, step_dir(step), name)
        with store._errors(url):
            size = store.fs.size(path) if store.fs.exists(path) else None
        if size != info.get("bytes"):
            found = "missing" if size is None else f"{size} bytes, meta.json says {info.get('bytes')}"
            raise RuntimeFailure(f"{url}: the checkpoint at step {step} is incomplete ({found})",
                                 hint="resume from an older step with --resume-step, or --fresh --force")


def central_store(run: Run) -> CheckpointStore:
    """The centralized reference's own store, ``<checkpoints.store>/central``."""
    return CheckpointStore(storage.join(run.checkpoints.store, CENTRAL_DIR), run.checkpoints.keep_last)


def plan(run: Run, store: Optional[CheckpointStore] = None, stages: Optional[Sequence[str]] = None,
         resume_step: Optional[int] = None, fresh: bool = False, force: bool = False,
         apply: bool = True) -> ResumePlan:
    """Decide from the store (default: ``checkpoints.store`` and every stage of the run); with `apply`,
    move the old checkpoints aside when starting over and bind the store to this run."""
    store = store or CheckpointStore(run)
    stages = list(stages or run.stage_names())
    here, there = identity(run), read_identity(store)
    complete = {s: store.steps(s) for s in stages}
    step, action = decide(here, there, complete, stages, run.training.max_steps, store.url, resume_step,
                          fresh, force, run.training.until_step)
    result = ResumePlan(step, action, store.url, complete, identity=here,
                        forced=force and there is not None and there.get("hash") != here["hash"])
    if action == "resume":
        for s in stages:
            check_files(store, s, step)
    if apply:
        if action == "start-over":
            result.moved_aside = move_aside(store)
            there = None
        elif action == "resume":
            result.moved_aside = set_aside_later(store, stages, step)
        if there is None:  # a store adopted with --force keeps its owner's identity (--force each time)
            there = bind(store, here)
    result.binding = there.get("bound") if there else None
    return result

