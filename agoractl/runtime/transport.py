"""The trainer–worker channel (report §3.3): stage RPCs over hivemind's libp2p ``P2P``.

Moves named tensors and a small msgpack metadata dict, nothing more: the worker decides what a
request means (:mod:`agoractl.training.worker`), the trainer what to send (:mod:`agoractl.runtime.trainer`).
Four unary methods, registered under a ``<run>.<stage>`` namespace so a request can only reach the
stage it was meant for:

- ``forward``: ids (+ the previous stage's wire) → the stage's output wire
- ``backward``: ids, the stage's input wire, the gradient of its output → the gradient of its input;
  the worker recomputes the forward and accumulates parameter gradients
- ``forward_backward``: the tail's fused call — forward, loss and backward in one request → the
  per-sample losses and the gradient of its input (no recompute, one round trip less)
- ``notice``: a trainer tells a worker it rejected that worker's output (metadata ``reason``); no
  tensors either way (:mod:`agoractl.algorithms.validation`, rule ``refused_outputs``)

Tensors travel as hivemind ``runtime_pb2.Tensor`` (dtype kept: fp32, bf16 or fp16 wire tensors,
int32 token ids); a handler's exception reaches the caller as an error, which the trainer treats as
a failed call.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Optional

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

METHODS = ("forward", "backward", "forward_backward", "notice")

Handler = Callable[[str, dict[str, torch.Tensor], dict, str], Awaitable[tuple[dict[str, torch.Tensor], dict]]]
"""handler(method, tensors, metadata, caller peer id) → (tensors, metadata)."""


def namespace(run: str, stage: str) -> str:
    return f"{run}.{stage}"


def pack(tensors: dict[str, torch.Tensor], meta: Optional[dict] = None, cls=runtime_pb2.ExpertRequest, uid: str = ""):
    names = list(tensors)
    body = {"names": names, **(meta or {})}
    kwargs = {"uid": uid} if cls is runtime_pb2.ExpertRequest else {}
    return cls(tensors=[serialize_torch_tensor(tensors[n]) for n in names],
               metadata=MSGPackSerializer.dumps(body), **kwargs)


def unpack(message) -> tuple[dict[str, torch.Tensor], dict]:
    meta = MSGPackSerializer.loads(message.metadata) if message.metadata else {}
    names = meta.pop("names", [])
    if len(names) != len(message.tensors):
        raise ValueError(f"message names {len(names)} tensors but carries {len(message.tensors)}")
    return {n: deserialize_torch_tensor(t) for n, t in zip(names, message.tensors)}, meta


class StageServicer(ServicerBase):
    """Serves a stage's three methods by handing every request to `handler`."""

    def __init__(self, handler: Handler, gate: Optional[Callable[[dict, str], None]] = None):
        self.handler, self.gate = handler, gate
        """gate(metadata, caller peer id) raises to refuse a request (admission on: the caller's credential)."""

    async def _serve(self, method: str, request: runtime_pb2.ExpertRequest, context: P2PContext):
        tensors, meta = unpack(request)
        caller = context.remote_id.to_base58() if context.remote_id is not None else ""
        if self.gate is not None:
            self.gate(meta, caller)
        out, out_meta = await self.handler(method, tensors, meta, caller)
        return pack(out, out_meta, cls=runtime_pb2.ExpertResponse)

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._serve("forward", request, context)

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._serve("backward", request, context)

    async def rpc_forward_backward(self, request: runtime_pb2.ExpertRequest,
                                   context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._serve("forward_backward", request, context)

    async def rpc_notice(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._serve("notice", request, context)


class StageClient:
    """Calls stage methods on workers through a P2P instance (the trainer's)."""

    def __init__(self, p2p: P2P, run: str, credential: Optional[Callable[[], str]] = None):
        self.p2p, self.run, self.credential = p2p, run, credential
        """credential() is this caller's current credential, sent with every request (admission on)."""
        self._peers: dict[str, PeerID] = {}

    def _peer(self, peer: str) -> PeerID:
        pid = self._peers.get(peer)
        if pid is None:
            pid = self._peers[peer] = PeerID.from_base58(peer)
        return pid

    async def call(self, peer: str, stage: str, method: str, tensors: dict[str, torch.Tensor],
                   meta: Optional[dict] = None, timeout: Optional[float] = None) -> tuple[dict[str, torch.Tensor], dict]:
        if method not in METHODS:
            raise ValueError(f"unknown stage method {method!r}")
        if self.credential is not None:
            meta = {**(meta or {}), "cred": self.credential()}
        stub = StageServicer.get_stub(self.p2p, self._peer(peer), namespace=namespace(self.run, stage))
        response = await getattr(stub, f"rpc_{method}")(pack(tensors, meta, uid=stage), timeout=timeout)
        return unpack(response)
