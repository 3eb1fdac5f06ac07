"""Building and counting a run's modules: one stage alone (only its own parameters allocated) or
the monolithic model, Llama or surrogate as the manifest says, and the counts the plan reads."""

from __future__ import annotations

import torch
from torch import nn

from agoractl.manifest.plan import StageCounts
from agoractl.manifest.schema import Run
from agoractl.model.llama import LlamaModel, LlamaStage, StageModule, initialize_
from agoractl.model.surrogate import SurrogateModel, SurrogateStage


def _materialize(factory, run: Run, device) -> nn.Module:
    """Build on the meta device (no memory), then allocate on `device` and initialise there."""
    device = torch.device(device)
    with torch.device("meta"):
        module = factory()
    if device.type != "meta":
        module.to_empty(device=device)
        initialize_(module, run)
    return module


def build_stage(run: Run, index: int, device="cpu") -> StageModule:
    """Stage `index` alone, from the manifest: only its own parameters are allocated.

    ``device="meta"`` builds the structure without memory (for counting)."""
    if not 0 <= index < len(run.stages):
        raise IndexError(f"stage index {index} out of range; the run has {len(run.stages)} stages")
    if run.model.family == "surrogate":
        return _materialize(lambda: SurrogateStage(run, index), run, device)
    return _materialize(lambda: LlamaStage(run, index), run, device)


def build_model(run: Run, device="cpu") -> nn.Module:
    """The monolithic model; its state_dict keys are the union of all stages' keys."""
    if run.model.family == "surrogate":
        return _materialize(lambda: SurrogateModel(run), run, device)
    return _materialize(lambda: LlamaModel(run), run, device)


# ---- counting -------------------------------------------------------------------------------------

def dense_equivalent(run: Run) -> Run:
    """The same run with dense boundaries (model.ssn.rank null)."""
    ssn = run.model.ssn.model_copy(update={"rank": None})
    return run.model_copy(update={"model": run.model.model_copy(update={"ssn": ssn})})


def count_module(module: nn.Module) -> tuple[int, int]:
    """(trainable parameters, fixed SSN buffers: U_k and T_fixed) of a built module (meta is fine)."""
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    codec = getattr(module, "codec", None)
    buffers = sum(b.numel() for b in codec.buffers()) if codec is not None else 0
    return trainable, buffers


def model_stage_counts(run: Run, index: int) -> StageCounts:
    """Stage `index` counted from the modules themselves (built on the meta device)."""
    trainable, buffers = count_module(build_stage(run, index, "meta"))
    dense, _ = count_module(build_stage(dense_equivalent(run), index, "meta"))
    return StageCounts(trainable, dense, buffers)


def stage_parameter_names(run: Run, index: int) -> list[str]:
    """Names of stage `index`'s parameters (as in its state_dict), in order."""
    return [n for n, _ in build_stage(run, index, "meta").named_parameters()]
