"""Joining a running stage (report §3.3.1.1): the stage state a worker serves to joiners and loads.

The state is the stage's trainable parameters and its AdamW state at a step. Operators serve it
directly to joining peers (hivemind's ``rpc_download_state`` through the stage's averager, or the direct
mixing transport's ``rpc_state`` for FGDiLoCo's ``transport: direct``; metadata + tensors built by
:func:`pack_state`; :func:`serve_state`); every replica can also come from the
checkpoint store (:func:`join_stage` tries both).
Operators ask live peers first, contributors the store first (the report: contributors load from
periodically refreshed checkpoints, to spare the operators' bandwidth); with neither, a worker
starts from the manifest's initial weights (step 0). How far behind its stage the loaded step is
decides whether it goes through the sync phases (:mod:`agoractl.algorithms.sync_phases`).

A stage with no replica left while the others train on rejoins at the run's step
(:func:`agoractl.algorithms.progress.run_position`, :func:`agoractl.training.stage_resume.rejoin_stage`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from agoractl.ops import optimizer_state as opt_codec
from agoractl.ops.checkpoint import Checkpoint, CheckpointStore
from agoractl.manifest.schema import Run


def pack_state(named_params: Sequence[tuple[str, torch.Tensor]], optimizer: Optional[torch.optim.Optimizer],
               stage: str, step: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """(msgpack-able metadata, tensors) of a stage's state: parameters first, then optimizer tensors."""
    names = [n for n, _ in named_params]
    tensors = [p.detach().to("cpu", copy=True) for _, p in named_params]
    meta: dict[str, Any] = {"stage": stage, "step": int(step), "names": names}
    if optimizer is not None:
        opt_tensors: dict[str, torch.Tensor] = {}
        meta["optimizer"] = opt_codec.encode(optimizer.state_dict(), opt_tensors)
        meta["optimizer_tensors"] = list(opt_tensors)
        tensors += [opt_tensors[k] for k in meta["optimizer_tensors"]]
    return meta, tensors


def unpack_state(meta: dict[str, Any], tensors: Sequence[torch.Tensor]) -> Checkpoint:
    """The inverse of :func:`pack_state`, as a :class:`~agoractl.ops.checkpoint.Checkpoint`."""
    names = list(meta["names"])
    if len(tensors) < len(names):
        raise ValueError(f"state has {len(tensors)} tensors for {len(names)} parameters")
    model = {n: t for n, t in zip(names, tensors)}
    opt = None
    if "optimizer" in meta:
        keys = list(meta["optimizer_tensors"])
        rest = list(tensors[len(names):])
        if len(rest) != len(keys):
            raise ValueError(f"state has {len(rest)} optimizer tensors; its metadata names {len(keys)}")
        opt = opt_codec.decode(meta["optimizer"], dict(zip(keys, rest)))
    return Checkpoint(model, opt, {"stage": meta.get("stage"), "step": int(meta["step"])})


def load_stage_state(role: str, from_peers: Callable[[], Optional[Checkpoint]],
                     from_store: Callable[[], Optional[Checkpoint]]) -> tuple[Optional[Checkpoint], str]:
    """(state, source): operators try live peers then the store, contributors the other way round;
    source is ``peer``, ``store`` or ``init`` (nothing found: the manifest's initial weights)."""
    order = [("peer", from_peers), ("store", from_store)]
    if role == "contributor":
        order.reverse()
    for source, fetch in order:
        try:
            state = fetch()
        except Exception:  # an unreachable peer or store is not fatal: try the other source
            state = None
        if state is not None:
            return state, source
    return None, "init"


@torch.no_grad()
def apply_state(state: Checkpoint, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                master: Optional[Sequence[torch.Tensor]] = None) -> int:
    """Load `state` into the stage module (and its optimizer), refresh CPU master copies if the
    module computes elsewhere; returns the state's step."""
    step = state.apply_to(module, optimizer)
    params = [p for p in module.parameters() if p.requires_grad]
    if master is not None and master is not params and len(master) == len(params):
        for m, p in zip(master, params):
            if m is not p:
                m.copy_(p.detach().to(m.device))
    return step


def serve_state(worker) -> Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]:
    """The stage state a worker serves to joining peers (called on hivemind's background thread)."""
    names = [n for n, p in worker.module.named_parameters() if p.requires_grad]
    return lambda: pack_state(list(zip(names, worker.master)), worker.optimizer, worker.name, worker.progress.step)


def join_stage(run: Run, worker, averager, stage_step: int) -> tuple[str, int]:
    """(source, loaded step) of a worker joining its stage at `stage_step`: a stage that already
    trained hands it its state from a live peer (through `averager`, the stage's averager or direct mixing
    transport: anything with ``load_stage_state``) or the checkpoint
    store, in the worker's role's order; ``("init", 0)`` when the stage is new or nothing was found."""
    if stage_step <= 0:
        return "init", 0

    def from_peers() -> Optional[Checkpoint]:
        found = averager.load_stage_state(timeout=run.network.startup_timeout_s)
        return None if found is None else unpack_state(*found)

    def from_store() -> Optional[Checkpoint]:
        store = CheckpointStore(run)
        return None if store.latest_step(worker.name) is None else store.load(worker.name)

    state, source = load_stage_state(worker.role, from_peers, from_store)
    if state is None:
        return "init", 0
    return source, apply_state(state, worker.module, worker.optimizer, worker.master)

