"""Credential checks on the averaging RPCs when the manifest's admission is on (report §3.6.1.5).

hivemind's averager serves the replicas of a stage three RPCs: matchmaking (``rpc_join_group``), the
all-reduce (``rpc_aggregate_part``) and the state download of joining workers (``rpc_download_state``).
:class:`AdmittedAverager`, a :class:`~agoractl.runtime.averaging.StageAverager`, gates all three and adds a
fourth, ``rpc_credential``, the handshake:

- Before its first averaging RPC to a peer, after each renewal of its credential, and at least every
  :data:`REPRESENT_S`, a caller presents its credential there and receives the callee's. Each side checks the
  other's against the peer id that libp2p's secure channel authenticated for the connection: a worker of this
  run and this stage, signed by the run's authority, not expired, not banned.
- Every gated RPC re-checks the caller's last presented credential, so expiry and the ban list apply mid-run,
  and a peer that presented none, or a bad one, is refused with that reason however it found the leader
  (through the DHT or by dialling it directly).
- The calling side needs no change to hivemind: every averaging RPC hivemind makes goes through ``get_stub``
  of the servicer class (matchmaking, the all-reduce runner, the state download), which this class overrides
  to present the credential first. A callee whose own credential fails counts as a failed peer there.

The credential and the ban list reach the averager's process through shared memory
(:meth:`AdmittedAverager.set_credential`, called by the node's renewal thread); refusals are counted in shared
memory too, by surface and reason (:meth:`AdmittedAverager.auth_stats`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import multiprocessing as mp
import time
from typing import AsyncIterator, Iterable, Optional

from hivemind.p2p import P2PContext, P2PHandlerError
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.asyncio import achain, anext, as_aiter

from agoractl.auth import keys
from agoractl.auth.credential import REFUSALS, CredentialRefused, Verifier
from agoractl.runtime.averaging import StageAverager, stage_averager

SURFACES = ("averaging_credential", "averaging_join", "averaging_part", "averaging_state", "averaging_callee")
"""Where a credential was refused: the handshake, the three gated RPCs, and a callee's answer to the handshake."""
REPRESENT_S = 30.0
"""A caller presents its credential again at least this often (a callee that restarted has forgotten it)."""
_SLOT = 1 << 16
_REMEMBERED = 4096


class AdmittedAverager(StageAverager):
    """A :class:`StageAverager` whose peers must hold a valid credential for this run and stage.

    `run_name`, `stage_name`: what a peer's credential must name; `authority_public_key`: the run's authority
    (text form); `token`, `bans`: this node's credential and the published ban list, kept current through
    :meth:`set_credential`. Other arguments are :class:`StageAverager`'s.
    """

    _rpc_handlers = None  # hivemind caches a servicer's handlers per class: this class has one more
    _stub_type = None
    _active: Optional["AdmittedAverager"] = None
    """The averager of this process (hivemind runs each averager in a process of its own); None elsewhere."""

    def __init__(self, dht, *, run_name: str, stage_name: str, authority_public_key: str, token: Optional[str],
                 bans: Iterable[str] = (), **kwargs):
        self.run_name, self.stage, self.public_text = run_name, stage_name, authority_public_key
        keys.parse_public(authority_public_key)  # fail here, in the host process, on a bad key
        self._auth_shared = mp.Array(ctypes.c_char, _SLOT)
        self._auth_version = mp.Value(ctypes.c_int64, 0)
        self._auth_counts = mp.Array(ctypes.c_int64, 1 + len(SURFACES) * len(REFUSALS))
        self._auth_seen, self._auth_token, self._auth_bans, self._verifier = -1, None, frozenset(), None
        self._presented: collections.OrderedDict[str, Optional[str]] = collections.OrderedDict()
        """Averager process: the credential each caller presented last (bounded; oldest forgotten first)."""
        self._told: dict[str, tuple[Optional[str], float]] = {}
        """Averager process: the credential this peer last presented to each callee, and when."""
        self.set_credential(token, bans)
        super().__init__(dht, **kwargs)

    # ---- host side -------------------------------------------------------------------------------

    def set_credential(self, token: Optional[str], bans: Iterable[str]) -> None:
        """Hand the averager's process this node's current credential and the ban list (any thread)."""
        data = MSGPackSerializer.dumps([token or "", sorted(bans)])
        if len(data) + 4 > _SLOT:
            raise ValueError(f"credential and ban list take {len(data)} bytes; at most {_SLOT - 4} fit")
        with self._auth_shared.get_lock():
            self._auth_shared.raw = len(data).to_bytes(4, "big") + data
            self._auth_version.value += 1

    def auth_stats(self) -> dict:
        """Credentials checked on the averaging RPCs, and refusals by ``surface:reason`` (any process)."""
        with self._auth_counts.get_lock():
            counts = list(self._auth_counts)
        refused = {f"{s}:{r}": counts[1 + i * len(REFUSALS) + j] for i, s in enumerate(SURFACES)
                   for j, r in enumerate(REFUSALS) if counts[1 + i * len(REFUSALS) + j]}
        return {"checked": counts[0], "refused": refused}

    # ---- averager process ------------------------------------------------------------------------

    def run(self):
        AdmittedAverager._active = self
        # A refusal raised in a streaming handler reaches the caller as its error message, and is counted here;
        # hivemind would also log it with a traceback at WARNING, which a rogue peer could use to flood the log.
        logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(not_a_refusal)
        super().run()

    def _own(self) -> tuple[Optional[str], frozenset]:
        if self._auth_version.value != self._auth_seen:
            with self._auth_shared.get_lock():
                raw, self._auth_seen = self._auth_shared.raw, self._auth_version.value
            token, bans = MSGPackSerializer.loads(raw[4:4 + int.from_bytes(raw[:4], "big")])
            self._auth_token, self._auth_bans = token or None, frozenset(bans)
        return self._auth_token, self._auth_bans

    def _check(self, surface: str, peer: str, token: Optional[str]) -> None:
        """Refuse (PermissionError, counted) unless `token` is a valid credential of a worker of this stage
        bound to `peer`."""
        if self._verifier is None:
            self._verifier = Verifier(keys.parse_public(self.public_text))
        _, bans = self._own()
        with self._auth_counts.get_lock():
            self._auth_counts[0] += 1
        try:
            self._verifier.verify(token, run=self.run_name, peer_id=peer, role="worker", stage=self.stage,
                   banned=bans)
        except CredentialRefused as e:
            with self._auth_counts.get_lock():
                self._auth_counts[1 + SURFACES.index(surface) * len(REFUSALS) + REFUSALS.index(e.reason)] += 1
            raise PermissionError(f"credential refused: {e.reason}") from None

    def _gate(self, surface: str, context: P2PContext) -> None:
        peer = context.remote_id.to_base58()
        self._check(surface, peer, self._presented.get(peer))

    async def rpc_credential(self, request: runtime_pb2.ExpertRequest,
                             context: P2PContext) -> runtime_pb2.ExpertResponse:
        """The handshake: remember the caller's credential, check it, answer with this peer's own."""
        peer = context.remote_id.to_base58()
        meta = MSGPackSerializer.loads(request.metadata) if request.metadata else {}
        token = meta.get("cred") if isinstance(meta, dict) else None
        self._presented[peer] = token if isinstance(token, str) else None
        self._presented.move_to_end(peer)
        while len(self._presented) > _REMEMBERED:
            self._presented.popitem(last=False)
        self._check("averaging_credential", peer, self._presented[peer])
        return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"cred": self._own()[0]}))

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        self._gate("averaging_join", context)
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        first = await anext(stream)
        try:
            self._gate("averaging_part", context)
        except PermissionError:
            # Read (at most) the end of a one-part stream before answering: closing a stream with unread input
            # resets it, and the caller would see a broken connection instead of the reason.
            with contextlib.suppress(asyncio.TimeoutError, StopAsyncIteration):
                await asyncio.wait_for(anext(stream), 1.0)
            raise
        async for message in super().rpc_aggregate_part(achain(as_aiter(first), stream), context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        self._gate("averaging_state", context)
        async for message in super().rpc_download_state(request, context):
            yield message

    @classmethod
    def get_stub(cls, p2p, peer, *, namespace: Optional[str] = None):
        stub = super().get_stub(p2p, peer, namespace=namespace)
        return stub if cls._active is None else _Presenting(stub, cls._active)

    async def _present(self, stub) -> None:
        """Present this peer's credential to the stub's peer unless done recently with the same one, and check
        the callee's answer (a refusal either way raises P2PHandlerError: hivemind then skips that peer)."""
        peer = stub._peer.to_base58()
        token, _ = self._own()
        told = self._told.get(peer)
        if told is not None and told[0] == token and time.monotonic() - told[1] < REPRESENT_S:
            return
        reply = await stub.rpc_credential(runtime_pb2.ExpertRequest(metadata=MSGPackSerializer.dumps({"cred": token})),
                                          timeout=self.request_timeout_s)
        meta = MSGPackSerializer.loads(reply.metadata) if reply.metadata else {}
        theirs = meta.get("cred") if isinstance(meta, dict) else None
        try:
            self._check("averaging_callee", peer, theirs if isinstance(theirs, str) else None)
        except PermissionError as e:
            raise P2PHandlerError(f"{peer}: {e}") from None
        self._told[peer] = (token, time.monotonic())


def not_a_refusal(record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not (isinstance(error, PermissionError) and str(error).startswith("credential refused"))


class _Presenting:
    """A hivemind stub whose averaging RPCs present the caller's credential first (the handshake)."""

    def __init__(self, stub, averager: AdmittedAverager):
        self._stub, self._averager = stub, averager

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)
        if not name.startswith("rpc_") or name == "rpc_credential":
            return method

        async def call(*args, **kwargs):
            await self._averager._present(self._stub)
            return await method(*args, **kwargs)

        return call


def admitted_averager(run, stage: str, role: str, dht, capacity: int, admitted) -> AdmittedAverager:
    """:func:`~agoractl.runtime.averaging.stage_averager` for a node the Authorizer admitted (`admitted`, an
    :class:`~agoractl.runtime.admission.Admitted`): its averaging RPCs check credentials; it follows the
    node's renewals and the ban list, and its refusals go into the node's admission statistics."""
    averager = stage_averager(run, stage, role, dht, capacity, cls=AdmittedAverager, run_name=run.metadata.name,
                              stage_name=stage, authority_public_key=admitted.auth.public_text, token=admitted.token,
                              bans=admitted.auth.bans)
    admitted.listeners.append(averager.set_credential)
    averager.set_credential(admitted.token, admitted.auth.bans)  # a renewal may have come in meanwhile
    admitted.sources.append(averager.auth_stats)
    return averager
