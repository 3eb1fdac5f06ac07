"""What every command shares: option aliases (``Annotated``), the options with a fixed set of values
(as Enums, so ``--help`` lists them and a wrong value gets click's one wording everywhere), the checks
of ``--stage``, ``--role`` and ``--device`` (each in one place), and manifest loading."""

from __future__ import annotations

import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Optional

import typer

from agoractl.errors import UsageError
from agoractl.manifest.loader import load_manifest
from agoractl.manifest.schema import Run

ManifestArg = Annotated[Path, typer.Argument(help="Run manifest (YAML).", show_default=False)]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="Override a manifest field before validation: dotted.path=value (repeatable).",
                 show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout; no colour, no progress.")]


# -- options with a fixed set of values (the library's own names; tests/cli/test_common.py checks them) --

class Role(StrEnum):
    """A worker's part in data-parallel averaging (report §3.3.1)."""

    operator = "operator"
    """Reduces chunks for its group and sends its own."""
    contributor = "contributor"
    """Only sends; never reduces."""


class FaultPoint(StrEnum):
    """Where ``ops preempt`` strikes in an averaging round (``agoractl.runtime.faults.FAULT_POINTS``)."""

    send = "send"
    reduce = "reduce"


class ArParams(StrEnum):
    """Parameters in the all-reduce payload of ``manifest plan``."""

    dense = "dense"
    trainable = "trainable"


class Scenario(StrEnum):
    """The ``simulate`` scenarios."""

    fgdiloco = "fgdiloco"
    sparta_backward = "sparta-backward"
    sparta_participation = "sparta-participation"


class SimData(StrEnum):
    """Where ``simulate`` takes its samples from."""

    auto = "auto"
    shards = "shards"
    synthetic = "synthetic"


class GlobalMixing(StrEnum):
    """Cost model of a global mixing in ``simulate`` (``agoractl.sim.comm_model.GLOBAL_MIXING``)."""

    butterfly = "butterfly"
    all_to_all = "all-to-all"


RoleOpt = Annotated[Role, typer.Option("--role", help="operator (reduces in averaging) or contributor (only sends).")]
StageOpt = Annotated[str, typer.Option("--stage", help="Stage name (see `agoractl manifest plan FILE`).",
                                       show_default=False)]


def load(path: Path, overrides: Optional[list[str]]) -> Run:
    """Load and validate a manifest with --set overrides (raises ManifestError, exit 2)."""
    return load_manifest(path, overrides or [])


def check_stage(run: Run, stage: str, allow_auto: bool = False) -> str:
    """`stage` if the run has it (or it is ``auto`` where allowed), else a usage error naming the stages."""
    names = run.stage_names()
    if stage in names or (allow_auto and stage == "auto"):
        return stage
    raise UsageError(f"--stage {stage}: no such stage; stages are {', '.join(names)}{' (or auto)' if allow_auto else ''}",
                     hint="`agoractl manifest plan FILE` lists the stages")


def stage_index(run: Run, stage: str) -> int:
    """The index of --stage STAGE in the run, or a usage error naming the stages (exit 2)."""
    return run.stage_names().index(check_stage(run, stage))


DEVICE_NAME = re.compile(r"cpu|cuda(:\d+)?")


def check_device(device: str, allow_auto: bool = False) -> str:
    """`device` if it names a torch device this CLI accepts (cpu, cuda, cuda:N; auto where allowed)."""
    if DEVICE_NAME.fullmatch(device) or (allow_auto and device == "auto"):
        return device
    raise UsageError(f"--device {device}: not a device name",
                     hint=f"use {'auto, ' if allow_auto else ''}cpu, cuda or cuda:N")


def require_cuda(device: str) -> None:
    """A usage error when `device` is a CUDA device and this machine has none. Asks NVML, not the CUDA driver:
    ``launch swarm`` forks its nodes afterwards, and a CUDA context made before a fork is useless in the child."""
    if not device.startswith("cuda"):
        return
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine", hint="use --device cpu")
