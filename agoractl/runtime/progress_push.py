"""The replicas of a stage push their progress straight to each other over libp2p (report §4.2's collective batch).

A replica steps once its stage has collectively seen ``training.global_batch_size`` samples
(:class:`~agoractl.algorithms.progress.StageProgress`). Every replica also files its count in the DHT, but a
store and a read there take a good part of a second, while a step of a run on CPUs can take a fifth of one: a
view of the peers built from the DHT alone jumped by several steps' samples at a time, so replicas stepped in
bursts, one step with no sample and the next with twice the batch (local-cpu, 2 workers per stage: in 8 of the
head's 60 steps neither replica had a sample, in 7 both had a whole batch). So every replica pushes its
``(step, total, seen)`` to each live replica of its stage whenever they change: ``rpc_progress`` under the
``<run>.<stage>.progress`` namespace, on the connection handler's P2P, with no tensor. At most one push per
peer is on its way; a change meanwhile is sent after it, the latest value only. A failed push is dropped (the
DHT's record still carries the count). The DHT stays the record of who is live, and of where a joiner counts
from; a push only moves a peer's count and step forward (:meth:`StageProgress.heard`).

With admission on, a push carries the sender's credential, which must name a worker of this run and stage bound
to the sender's libp2p peer id; a refused push changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable, Optional

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from agoractl.algorithms.progress import PeerProgress
from agoractl.runtime.averaging_auth import not_a_refusal
from agoractl.runtime.transport import pack, unpack

PUSH_TIMEOUT_S = 2.0
"""The longest one push may take; a slower one is dropped (the next change is sent anyway)."""

Gate = Callable[[Optional[str], str], None]
"""gate(credential, caller peer id) raises PermissionError to refuse (admission on)."""


def read_progress(meta: dict) -> PeerProgress:
    """The progress a push carries; ValueError names what is wrong with it."""
    values = {}
    for field in ("step", "total", "seen"):
        value = meta.get(field, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"a progress push's {field} must be a non-negative integer; got {value!r}")
        values[field] = value
    return PeerProgress(values["step"], values["total"], values["seen"])


class ProgressPush(ServicerBase):
    """Pushes this replica's progress to its stage's replicas and takes in theirs (see the module docstring).

    `on_progress(peer, progress)` receives every accepted push, on the P2P loop; `gate` and `token`: admission
    (the check of a sender's credential, this node's own credential)."""

    def __init__(self, namespace: str, on_progress: Callable[[str, PeerProgress], None], *,
                 gate: Optional[Gate] = None, token: Callable[[], Optional[str]] = lambda: None,
                 timeout_s: float = PUSH_TIMEOUT_S):
        self.namespace, self.on_progress, self.gate, self.token = namespace, on_progress, gate, token
        self.timeout_s = float(timeout_s)
        if gate is not None:  # a refusal reaches the caller; hivemind would also log it with a traceback
            logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(not_a_refusal)
        self.p2p: Optional[P2P] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.latest: Optional[PeerProgress] = None
        self._sending: dict[str, asyncio.Task] = {}
        self._stale: set[str] = set()  # peers whose push on its way carries an older value than `latest`
        self.counts = {"sent": 0, "failed": 0, "received": 0, "refused": 0}

    async def open(self, p2p: P2P) -> None:
        """Serve pushes on `p2p` (call on its loop)."""
        self.p2p, self.loop = p2p, asyncio.get_running_loop()
        await self.add_p2p_handlers(p2p, namespace=self.namespace)

    async def close(self) -> None:
        for task in self._sending.values():
            task.cancel()
        if self.p2p is not None:
            await self.remove_p2p_handlers(self.p2p, namespace=self.namespace)

    # ---- sending (any thread) -----------------------------------------------------------------------

    def push(self, peers: Iterable[str], mine: PeerProgress) -> None:
        """Send `mine` to every replica in `peers`; returns at once (no-op before :meth:`open`)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._push, list(peers), mine)

    def _push(self, peers: list[str], mine: PeerProgress) -> None:
        self.latest = mine
        for peer in peers:
            task = self._sending.get(peer)
            if task is not None and not task.done():
                self._stale.add(peer)
            else:
                self._sending[peer] = asyncio.ensure_future(self._send(peer))

    async def _send(self, peer: str) -> None:
        while True:
            self._stale.discard(peer)
            mine = self.latest
            meta = {"step": mine.step, "total": mine.total, "seen": mine.seen}
            token = self.token()
            if token is not None:
                meta["cred"] = token
            try:
                stub = self.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
                await stub.rpc_progress(pack({}, meta), timeout=self.timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.counts["failed"] += 1
                return
            self.counts["sent"] += 1
            if peer not in self._stale:
                return

    # ---- receiving (the P2P loop) -------------------------------------------------------------------

    async def rpc_progress(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        _, meta = unpack(request)
        caller = context.remote_id.to_base58()
        if self.gate is not None:
            try:
                self.gate(meta.pop("cred", None), caller)
            except PermissionError:
                self.counts["refused"] += 1
                raise
        progress = read_progress(meta)
        self.counts["received"] += 1
        self.on_progress(caller, progress)
        return runtime_pb2.ExpertResponse()
