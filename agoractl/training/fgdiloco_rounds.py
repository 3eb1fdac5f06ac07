"""FGDiLoCo outer rounds of one worker (seed 002; report §4.2): the replicas of a stage as DiLoCo replicas.

Attached to a :class:`~agoractl.training.worker.Worker` through its step callback, like SPARTA's
rounds (:mod:`agoractl.training.sparta_rounds`), and over the same averaging transport
(:class:`~agoractl.training.data_parallel.AveragingTransport`, through :class:`TransportMixing`).
The worker's ordinary optimizer steps are FGDiLoCo's inner steps; every
``data_parallel.fgdiloco.inner_steps`` (H) stage steps an outer round ends and the next begins:

- round start (stage step ``r * H``): the outer parameters z are the master weights, flattened in
  the module's parameter order (as :func:`agoractl.sim.simulator.flat_parameters` orders a full
  model); Mix1 of z starts in the **background** (:class:`Mixing`), while the H inner steps train;
- round end (stage step ``(r + 1) * H``): Δ = y_H − z (:func:`~agoractl.algorithms.fgdiloco.round_delta`),
  Mix1 is collected, Mix2 of Δ **blocks** the compute thread (replicas counting collectively reach the
  step together; replicas stepping on their own counts, ``data_parallel.fgdiloco.replicas``, wait there
  for each other, as DiLoCo's replicas do), and the replica's outer step
  (:func:`~agoractl.algorithms.fgdiloco.replica_outer_step`, Nesterov SGD with a momentum of its own)
  turns x = Mix1(z) and Δ̂ = Mix2(Δ) into the next z, written back into the master weights.

The maths are the simulator's own functions; this module only sequences them on the worker's
steps. Mixing that fails (no partner, a timeout) keeps the replica's own values, value by value
where a slice did not come back. Mixes are numbered 2r (Mix1) and 2r + 1 (Mix2) so replicas
only ever meet for the same mix. A worker joining mid-round trains along and enters at the next
round start. Each mix leaves a record and a ``round`` event (self-termination counts failures).
No networking here.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Protocol

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from agoractl import logs
from agoractl.algorithms.fgdiloco import OuterSGD, replica_outer_step, round_delta, variant_mixing
from agoractl.manifest.schema import Run
from agoractl.training.data_parallel import AveragingTransport


class MixHandle(Protocol):
    def done(self) -> bool: ...

    def result(self, timeout: Optional[float] = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """(mixed values — the replica's own where nothing came back, a record of the mix)."""


class Mixing(Protocol):
    """Moves one flat tensor among the stage's replicas: ``global`` (all) or ``local`` (a partner)."""

    def start(self, kind: str, index: int, values: torch.Tensor) -> MixHandle: ...


class Unmixed:
    """Mixing ``none`` (or no partner alive): the replica's own values, at once."""

    def __init__(self, values: torch.Tensor, record: dict[str, Any]):
        self.values, self.record = values, record

    def done(self) -> bool:
        return True

    def result(self, timeout: Optional[float] = None) -> tuple[torch.Tensor, dict[str, Any]]:
        return self.values.clone(), self.record


class TransportMix:
    """A mix running on the stage's averaging transport."""

    def __init__(self, pending, values: torch.Tensor, kind: str):
        self.pending, self.values, self.kind = pending, values, kind

    def done(self) -> bool:
        return self.pending.done()

    def result(self, timeout: Optional[float] = None) -> tuple[torch.Tensor, dict[str, Any]]:
        average, averaged, rec = self.pending.result(timeout=timeout)
        record = {**rec.as_dict(), "kind": self.kind}
        if average is None:
            return self.values.clone(), record
        return torch.where(averaged, average, self.values), record


class TransportMixing:
    """Mixing over the stage's :class:`~agoractl.training.data_parallel.AveragingTransport`: global =
    one group of every live replica, local = groups of two (hivemind's matchmaking pairs the replicas
    at random; one left over keeps its values)."""

    def __init__(self, transport: AveragingTransport, live_peers: Callable[[], int]):
        self.transport, self.live_peers = transport, live_peers

    def start(self, kind: str, index: int, values: torch.Tensor) -> MixHandle:
        if kind == "none":
            return Unmixed(values, {"round": index, "status": "skipped", "kind": kind})
        live = self.live_peers()
        if live < 2:
            return Unmixed(values, {"round": index, "status": "skipped", "kind": kind,
                                    "error": "no other replica of the stage"})
        expected = live if kind == "global" else 2
        pending = self.transport.begin_round(index, 0, values, 1.0, expected)
        return TransportMix(pending, values, kind)


class FGDiLoCoRounds:
    """The FGDiLoCo outer rounds of one worker on the stage's step cadence; registers itself as a
    step callback. `deadline_s` bounds the wait for a mix (the transport's round deadline)."""

    def __init__(self, run: Run, worker, mixing: Mixing, deadline_s: float = 600.0):
        fg = run.data_parallel.fgdiloco
        self.run, self.worker, self.mixing, self.deadline_s = run, worker, mixing, deadline_s
        self.kind1, self.kind2 = variant_mixing(fg.variant)
        self.inner_steps = fg.inner_steps
        self.outer = OuterSGD(lr=fg.outer_lr, momentum=fg.outer_momentum, nesterov=fg.nesterov)
        self.round: Optional[int] = None
        self.z: Optional[torch.Tensor] = None
        self.mix1: Optional[MixHandle] = None
        self.records: list[dict] = []
        self.log = logs.get("fgdiloco")
        worker.step_callbacks.append(self.on_step)

    # -- parameters ---------------------------------------------------------------------------

    def flat(self) -> torch.Tensor:
        return parameters_to_vector([m.detach() for m in self.worker.master]).float().clone()

    @torch.no_grad()
    def assign(self, flat: torch.Tensor) -> None:
        vector_to_parameters(flat.to(self.worker.master[0].dtype), list(self.worker.master))
        if self.worker.master is not self.worker.params:
            for p, m in zip(self.worker.params, self.worker.master):
                p.copy_(m, non_blocking=True)

    # -- rounds -------------------------------------------------------------------------------

    def start(self, stage_step: int) -> None:
        """Begin the current round if the worker starts on a round boundary (else at the next one)."""
        if self.round is not None:  # restored mid-round from a checkpoint
            return
        if stage_step == 0 and self.run.training.stop_step > 0:
            # A new run: every replica starts from the same seeded initialisation, so Mix1 of z is z. Not
            # mixing it spares a group that the replicas, started a moment apart, may each see alone.
            self.round, self.z = 0, self.flat()
            self.mix1 = Unmixed(self.z, {"round": 0, "status": "skipped", "kind": self.kind1,
                                         "error": "round 0 of a new run: every replica starts identical"})
        elif stage_step % self.inner_steps == 0 and stage_step < self.run.training.stop_step:
            self.begin(stage_step // self.inner_steps)

    def outer_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the outer loop: the round, its start parameters z, the momentum."""
        return {"round": self.round, "z": None if self.z is None else self.z.clone(),
                "buffer": None if self.outer.buffer is None else self.outer.buffer.clone()}

    def restore(self, state: Optional[dict], stage_step: int) -> None:
        """Continue the outer loop from a checkpoint's :meth:`outer_state` (a run resuming at `stage_step`).
        Mid-round, the round's Mix1 is not redone: every replica resumes from the same checkpoint, so the
        z they would mix are identical."""
        if not state:
            return
        self.outer.load_state_dict({"buffer": state.get("buffer")})
        if state.get("round") is not None and state.get("z") is not None and stage_step % self.inner_steps:
            self.round, self.z = int(state["round"]), state["z"].float().clone()
            self.mix1 = Unmixed(self.z, {"round": 2 * self.round, "status": "skipped", "kind": self.kind1,
                                         "error": "resumed mid-round from a checkpoint"})

    def begin(self, r: int) -> None:
        self.round, self.z = r, self.flat()
        self.mix1 = self.mixing.start(self.kind1, 2 * r, self.z)  # finishes in the background

    def on_step(self, step: int, worker) -> None:
        done = step + 1  # steps the stage has completed
        if done % self.inner_steps:
            return
        r = done // self.inner_steps - 1
        if self.round == r:
            self.finish()
        if done < self.run.training.stop_step:
            self.begin(r + 1)

    def finish(self) -> None:
        """End the running round: collect Mix1, Mix2 of Δ (blocking), the outer step into the weights."""
        t0 = time.monotonic()
        delta = round_delta(self.z, self.flat())
        self.worker.hold(True)  # on its own count, its peers may still need samples to get here: it takes none
        try:
            # Mix1 first: a replica's transport runs one mix at a time (it has had H steps to finish).
            x, rec1 = self._wait(self.mix1, self.z)
            mixed_delta, rec2 = self._wait(self.mixing.start(self.kind2, 2 * self.round + 1, delta), delta)
        finally:
            self.worker.hold(False)
        self.assign(replica_outer_step(x, mixed_delta, self.outer))
        for mix, rec in (("mix1", rec1), ("mix2", rec2)):
            self._record(mix, rec)
        self.log.debug("outer round", round=self.round, seconds=round(time.monotonic() - t0, 3))
        self.round, self.z, self.mix1 = None, None, None

    def _wait(self, handle: MixHandle, own: torch.Tensor) -> tuple[torch.Tensor, dict]:
        try:
            return handle.result(timeout=self.deadline_s)
        except Exception as e:  # the transport is gone or stuck: this mix keeps the local values
            return own.clone(), {"status": "failed", "error": f"{type(e).__name__}: {e}"[:300]}

    def _record(self, mix: str, rec: dict) -> None:
        d = {**rec, "mix": mix, "outer_round": self.round, "step": self.worker.progress.step}
        self.records.append(d)
        if d.get("status") in ("complete", "partial", "failed", "empty"):
            self.worker.emit("round", status=d["status"], round=d.get("round"), mix=mix)
        if d.get("status") in ("failed", "partial"):
            self.log.warning("mix", mix=mix, round=self.round, status=d["status"], error=d.get("error"))

    def summary(self) -> dict[str, Any]:
        """What goes into the worker's final stats."""
        outer = len({r["outer_round"] for r in self.records})
        ran = {m: [r for r in self.records if r["mix"] == m and r.get("status") != "skipped"] for m in ("mix1", "mix2")}
        success = {f"{m}_success_mean": (sum(r.get("averaging_success", 0.0) for r in rs) / len(rs)) if rs else None
                   for m, rs in ran.items()}
        return {"rounds": self.records, "fgdiloco": {"outer_rounds": outer, **success}}
