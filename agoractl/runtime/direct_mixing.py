"""FGDiLoCo mixes as direct pushes between the replicas of a stage (``data_parallel.fgdiloco.transport: direct``).

The replicas of a stage are known (they announce themselves in the DHT:
:class:`~agoractl.runtime.stage_peers.StagePeers`), so a mix needs no matchmaking and no all-reduce: every
replica streams its flat tensor to each partner over libp2p (hivemind's ``P2P``, a ``ServicerBase`` of three
RPCs under the ``<run>.<stage>.mix`` namespace) and averages what it got. :class:`DirectMixing` implements the
:class:`~agoractl.training.fgdiloco_rounds.Mixing` protocol:

- **partners**: ``global`` = every live replica (sorted peer ids); ``local`` = pairs of
  :func:`~agoractl.algorithms.fgdiloco.random_matching` seeded by the mix index over the sorted ids, so both
  sides of a pair pick each other; the one left over keeps its values (``skipped``). A global mix also takes a
  replica its own view missed when that one pushes the same index (and pushes back to it).
- **push** (``rpc_push``, a stream of chunks of ``chunk_bytes``, ``wire_dtype`` fp32 or bf16): the receiver
  hands the values to its open mix of that index, or keeps them in an inbox (a partner ahead of it; at most
  :data:`INBOX_INDICES` indices, the oldest dropped), and answers ``taken``, ``stored``, ``declined`` (a local
  mix that paired differently) or ``stale`` (the receiver is past that index). A receiver that moves past an
  index it holds pushes for without mixing them (it joined mid-round, it skipped) tells their senders
  (``rpc_decline``), so nobody waits for a replica that will not come.
- **end**: a mix ends when every partner's values came, or declined, or the partner is dead: its sends failed
  for :data:`DEAD_AFTER_S`, or it left the live set. A partner that is alive but late (still in its inner
  steps) is waited for until the deadline (``matchmaking_timeout_s + allreduce_timeout_s``).
- **result**: the mean over this replica and the partners whose values came, every contribution rounded
  through the wire dtype and summed in peer-id order, so every replica of a complete global mix holds the
  same values; with none, its own values. The record (a :class:`~agoractl.training.data_parallel.RoundRecord`
  as a dict): ``complete`` / ``partial`` / ``failed``, averaging_success = partners heard / partners, bytes
  counted from the payloads actually sent and received; non-finite values are dropped (``dropped_parts``).

It also serves the stage state to joining workers (``rpc_state``, streamed; :meth:`DirectMixing.load_stage_state`),
in place of the averager's ``rpc_download_state``, so a worker on this transport starts no averager process.
With admission on, every RPC checks the caller's credential (a worker of this run and stage, bound to the
libp2p peer id) and every answer carries the callee's, which the caller checks before using what it got.

The transport runs its own asyncio loop on a thread and its own P2P replica of the node's daemon.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from typing import AsyncIterator, Awaitable, Callable, Optional, Sequence

import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from agoractl.algorithms.fgdiloco import partner_of, random_matching
from agoractl.runtime.allreduce import wire_compression
from agoractl.runtime.averaging_auth import not_a_refusal
from agoractl.training.data_parallel import RoundRecord
from agoractl.training.fgdiloco_rounds import MixHandle, Unmixed

DEAD_AFTER_S = 2.0
"""A partner whose pushes kept failing this long is dead: the mix stops waiting for it."""
LIVE_CHECK_S = 1.0
"""Seconds between reads of the live replicas while a mix waits (a partner that left is not waited for)."""
REVERIFY_S = 30.0
"""Admission on: a replica checks a partner's credential again at least this often before pushing to it."""
INBOX_INDICES = 8
"""Mix indices whose early pushes the inbox holds; beyond, the oldest index is dropped."""

Gate = Callable[[Optional[str], str], None]
"""gate(credential, caller peer id) raises PermissionError to refuse (admission on)."""


def _meta(message) -> dict:
    meta = MSGPackSerializer.loads(message.metadata) if message.metadata else {}
    return meta if isinstance(meta, dict) else {}


class _Mix:
    """One open mix, on the transport's loop."""

    def __init__(self, index: int, kind: str, partners: list[str], payload: runtime_pb2.Tensor):
        self.index, self.kind, self.partners, self.payload = index, kind, list(partners), payload
        self.sending = False
        self.got: dict[str, torch.Tensor] = {}
        self.bytes_received = self.bytes_sent = self.dropped = 0
        self.declined: set[str] = set()  # partners that will not take part
        self.dead: set[str] = set()  # partners whose pushes kept failing, that left, or were refused
        self.errors: dict[str, str] = {}
        self.changed = asyncio.Event()
        self.sends: dict[str, asyncio.Task] = {}

    def settled(self) -> bool:
        """Every partner heard from (or declined, or dead), and every push of this replica's values ended:
        a partner may still be waiting for them."""
        return (all(p in self.got or p in self.declined or p in self.dead for p in self.partners)
                and all(task.done() for task in self.sends.values()))


class DirectMixing(ServicerBase):
    """Direct mixing among the replicas of a stage (see the module docstring).

    `connect`: an async callable returning this node's P2P (run on the transport's loop: a replica of the
    worker's daemon, :func:`direct_mixing`); `namespace`: the RPCs' namespace; `live_peers()`: peer ids of the
    stage's live replicas; `size`: values per mix (pushes of another size are refused); `deadline_s`: the
    longest a mix waits for a live partner; `send_timeout_s`: the longest one push may take; `gate`, `token`:
    admission (the check of a caller's credential, this node's own credential); `state_sources()`: peers to
    ask for the stage state, in order.
    """

    def __init__(self, connect: Callable[[], Awaitable[P2P]], namespace: str, live_peers: Callable[[], Sequence[str]],
                 *, size: int, deadline_s: float, send_timeout_s: float, wire_dtype: str = "fp32",
                 chunk_bytes: int = 2**19, gate: Optional[Gate] = None,
                 token: Callable[[], Optional[str]] = lambda: None,
                 state_sources: Callable[[], Sequence[str]] = lambda: (), startup_timeout_s: float = 60.0):
        self.namespace, self.live_peers, self.size = namespace, live_peers, int(size)
        self.round_deadline_s, self.send_timeout_s = float(deadline_s), float(send_timeout_s)
        self.wire, self.wire_dtype, self.chunk_bytes = wire_compression(wire_dtype), wire_dtype, int(chunk_bytes)
        self.gate, self.token, self.state_sources = gate, token, state_sources
        if gate is not None:  # a refusal reaches the caller; hivemind would also log it with a traceback
            logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(not_a_refusal)
        self.state_provider: Optional[Callable[[], tuple[dict, Sequence[torch.Tensor]]]] = None
        """Set by the node: the stage state served to joining workers (metadata, tensors)."""
        self.floor = 0
        """The lowest mix index this replica may still take part in; pushes below it are stale."""
        self.inbox: dict[int, dict[str, tuple[torch.Tensor, int]]] = {}
        self.open: dict[int, _Mix] = {}
        self._verified: dict[str, tuple[Optional[str], float]] = {}
        """Admission on: the credential this replica presented to each partner that accepted it, and when."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="direct-mixing", daemon=True)
        self._thread.start()
        try:
            self._call(self._open(connect), startup_timeout_s)
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise

    # ---- lifecycle -------------------------------------------------------------------------------

    def _call(self, coro, timeout: Optional[float] = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _open(self, connect) -> None:
        self.p2p = await connect()
        self.peer = self.p2p.peer_id.to_base58()
        await self.add_p2p_handlers(self.p2p, namespace=self.namespace)

    def visible_maddrs(self) -> list:
        return self._call(self.p2p.get_visible_maddrs())

    def shutdown(self) -> None:
        if not self._thread.is_alive():
            return

        async def close():
            for mix in list(self.open.values()):
                for task in mix.sends.values():
                    task.cancel()
            try:
                await self.remove_p2p_handlers(self.p2p, namespace=self.namespace)
            finally:
                await self.p2p.shutdown()

        try:
            self._call(close(), 10.0)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)

    # ---- mixing (caller's thread) ------------------------------------------------------------------

    def partners(self, kind: str, index: int, live: Sequence[str]) -> Optional[list[str]]:
        """This replica's partners in mix `index` of `kind` among `live` (None: left over in a local mix)."""
        ids = sorted(set(live) | {self.peer})
        if kind == "global":
            return [p for p in ids if p != self.peer]
        other = partner_of(random_matching(len(ids), random.Random(index)), ids.index(self.peer))
        return None if other is None else [ids[other]]

    def start(self, kind: str, index: int, values: torch.Tensor) -> MixHandle:
        """Begin mix `index` (``global``, ``local`` or ``none``) of `values` in the background."""
        skip = {"round": index, "segment": 0, "status": "skipped", "kind": kind, "transport": "direct"}
        partners = None if kind == "none" else self.partners(kind, index, self.live_peers())
        if not partners:
            self.loop.call_soon_threadsafe(self._advance, index + 1)
            why = (None if kind == "none" else "no other replica of the stage" if partners == []
                   else "left over in this mix's pairs")
            return Unmixed(values, {**skip, **({"error": why} if why else {})})
        flat = values.detach().reshape(-1).float().contiguous()
        if flat.numel() != self.size:
            raise ValueError(f"mix of {flat.numel()} values; this transport mixes {self.size}")
        serialized = self.wire.compress(flat, CompressionInfo.from_tensor(flat))
        own = deserialize_torch_tensor(serialized).float()  # what the partners will hold of it
        # A concurrent Future is a MixHandle (done(), result(timeout)): the mix's result, averaged off the loop.
        return asyncio.run_coroutine_threadsafe(self._mix(kind, index, partners, serialized, flat, own), self.loop)

    def _average(self, mix: _Mix, duration: float, flat: torch.Tensor, own: torch.Tensor):
        heard = [p for p in mix.partners if p in mix.got]
        n = len(mix.partners)
        if heard:
            contributions = {self.peer: own, **{p: mix.got[p] for p in heard}}
            total = torch.zeros_like(own)
            for peer in sorted(contributions):  # one order everywhere: a complete global mix agrees bit for bit
                total += contributions[peer]
            result = total / len(contributions)
        else:
            result = flat.clone()
        status = "complete" if len(heard) == n else "partial" if heard else "failed"
        missing = [p for p in mix.partners if p not in mix.got]
        error = None
        if missing:
            why = {p: mix.errors.get(p, "dead") if p in mix.declined or p in mix.dead else "no values by the deadline"
                   for p in missing}
            error = "; ".join(f"{p[-8:]}: {w}" for p, w in why.items())[:300]
        record = RoundRecord(
            round=mix.index, segment=0, status=status, group_size=1 + n, weight=1.0, group_weight=1.0 + len(heard),
            averaging_success=len(heard) / n, duration_s=round(duration, 4), bytes_sent=mix.bytes_sent,
            bytes_received=mix.bytes_received, dropped_parts=mix.dropped, snapshot_sum=float(flat.double().sum()),
            average_sum=float(result.double().sum()) if heard else None, error=error)
        return result, {**record.as_dict(), "kind": mix.kind, "transport": "direct"}

    # ---- mixing (transport's loop) -----------------------------------------------------------------

    async def _mix(self, kind: str, index: int, partners: list[str], serialized, flat: torch.Tensor,
                   own: torch.Tensor) -> tuple[torch.Tensor, dict]:
        t0 = time.monotonic()
        self._advance(index)
        mix = self.open[index] = _Mix(index, kind, partners, serialized)
        for sender, (values, nbytes) in self.inbox.pop(index, {}).items():
            if sender in partners or kind == "global":
                self._take(mix, sender, values, nbytes)
            else:
                asyncio.create_task(self._decline(sender, index))
        mix.sending = True
        for p in mix.partners:
            mix.sends[p] = asyncio.create_task(self._send(mix, p))
        deadline, next_check = t0 + self.round_deadline_s, t0 + LIVE_CHECK_S
        try:
            while not mix.settled() and time.monotonic() < deadline:
                mix.changed.clear()
                wait = min(deadline, next_check) - time.monotonic()
                try:
                    await asyncio.wait_for(mix.changed.wait(), max(0.0, wait))
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() >= next_check:  # a partner gone from the stage is not waited for
                    next_check = time.monotonic() + LIVE_CHECK_S
                    live = set(await self.loop.run_in_executor(None, self.live_peers))
                    for p in mix.partners:
                        if p not in live and p not in mix.got:
                            mix.dead.add(p)
                            mix.errors.setdefault(p, "left the stage")
        finally:
            for task in mix.sends.values():
                task.cancel()
            del self.open[index]
            self._advance(index + 1)
        return await self.loop.run_in_executor(None, self._average, mix, time.monotonic() - t0, flat, own)

    def _advance(self, floor: int) -> None:
        """Move past every index below `floor`: pushes held for them will never be mixed; tell their senders."""
        self.floor = max(self.floor, floor)
        for index in [i for i in self.inbox if i < self.floor]:
            for sender in self.inbox.pop(index):
                asyncio.ensure_future(self._decline(sender, index), loop=self.loop)

    def _take(self, mix: _Mix, sender: str, values: torch.Tensor, nbytes: int) -> None:
        if not bool(torch.isfinite(values).all()):
            mix.dropped += 1
            mix.errors[sender] = "sent non-finite values"
            mix.dead.add(sender)
        else:
            mix.got[sender] = values
            mix.bytes_received += nbytes
        if sender not in mix.partners:  # a global mix: a replica this one's view missed
            mix.partners.append(sender)
            if mix.sending:
                mix.sends[sender] = asyncio.create_task(self._send(mix, sender))
        mix.changed.set()

    def _stub(self, peer: str):
        return self.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)

    def _check_callee(self, reply, peer: str) -> None:
        if self.gate is not None:
            self.gate(_meta(reply).get("cred"), peer)

    async def _send(self, mix: _Mix, peer: str) -> None:
        """Push this replica's values to `peer` until it answers, declines, or counts as dead."""
        first_failure = None
        parts = list(split_for_streaming(mix.payload, self.chunk_bytes))
        head = MSGPackSerializer.dumps({"index": mix.index, "kind": mix.kind, "cred": self.token()})
        while True:
            try:
                await self._verify_callee(peer)
                messages = [runtime_pb2.ExpertRequest(tensors=[part], metadata=head if i == 0 else b"")
                            for i, part in enumerate(parts)]
                reply = await asyncio.wait_for(self._stub(peer).rpc_push(_aiter(messages)), self.send_timeout_s)
                self._check_callee(reply, peer)
                answer = _meta(reply).get("status")
                if answer in ("declined", "stale"):
                    mix.declined.add(peer)
                    mix.errors[peer] = answer
                else:
                    mix.bytes_sent += len(mix.payload.buffer)
                break
            except asyncio.CancelledError:
                raise
            except PermissionError as e:  # the callee's credential: do not use what it sends either
                mix.dead.add(peer)
                mix.errors[peer] = str(e)[:120]
                break
            except Exception as e:
                now = time.monotonic()
                first_failure = first_failure or now
                if now - first_failure >= DEAD_AFTER_S:
                    mix.dead.add(peer)
                    mix.errors[peer] = f"push failed: {type(e).__name__}: {e}"[:120]
                    break
                await asyncio.sleep(0.25)
        mix.changed.set()

    async def _verify_callee(self, peer: str) -> None:
        """Admission on: check `peer`'s credential before the first push to it (and every :data:`REVERIFY_S`), so
        that values go to admitted replicas only (``rpc_hello``, which checks this replica's credential too)."""
        if self.gate is None:
            return
        token, verified = self.token(), self._verified.get(peer)
        if verified is not None and verified[0] == token and time.monotonic() - verified[1] < REVERIFY_S:
            return
        request = runtime_pb2.ExpertRequest(metadata=MSGPackSerializer.dumps({"cred": token}))
        reply = await asyncio.wait_for(self._stub(peer).rpc_hello(request), self.send_timeout_s)
        self._check_callee(reply, peer)
        self._verified[peer] = (token, time.monotonic())

    async def _decline(self, peer: str, index: int) -> None:
        try:
            request = runtime_pb2.ExpertRequest(metadata=MSGPackSerializer.dumps({"index": index,
                                                                                  "cred": self.token()}))
            await asyncio.wait_for(self._stub(peer).rpc_decline(request), self.send_timeout_s)
        except Exception:  # it will stop waiting at its deadline, or when it finds this replica dead
            pass

    # ---- RPCs (transport's loop) -------------------------------------------------------------------

    def _gate(self, meta: dict, context: P2PContext) -> str:
        peer = context.remote_id.to_base58()
        if self.gate is not None:
            self.gate(meta.get("cred"), peer)
        return peer

    def _answer(self, **meta) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({**meta, "cred": self.token()}))

    async def rpc_push(self, stream: AsyncIterator[runtime_pb2.ExpertRequest],
                       context: P2PContext) -> runtime_pb2.ExpertResponse:
        """A partner's values for one mix, in chunks; the first chunk's metadata names the mix."""
        first = await stream.__anext__()
        meta = _meta(first)
        sender = self._gate(meta, context)
        index, kind = int(meta["index"]), str(meta.get("kind", ""))
        chunks = [first.tensors[0]]
        async for message in stream:
            chunks.append(message.tensors[0])
            if len(chunks) > first.tensors[0].chunks:
                raise ValueError("more chunks than announced")
        serialized = combine_from_streaming(chunks)
        values = deserialize_torch_tensor(serialized).float().reshape(-1)
        if values.numel() != self.size:
            raise ValueError(f"pushed {values.numel()} values; this stage mixes {self.size}")
        if index < self.floor:
            return self._answer(status="stale")
        mix = self.open.get(index)
        if mix is not None:
            if sender not in mix.partners and (mix.kind != "global" or kind != "global"):
                return self._answer(status="declined")
            self._take(mix, sender, values, len(serialized.buffer))
            return self._answer(status="taken")
        self.inbox.setdefault(index, {})[sender] = (values, len(serialized.buffer))
        while len(self.inbox) > INBOX_INDICES:
            oldest = min(self.inbox)
            for peer in self.inbox.pop(oldest):
                asyncio.create_task(self._decline(peer, oldest))
        return self._answer(status="stored")

    async def rpc_hello(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Admission on: the caller presents its credential before pushing values; the answer carries this one's."""
        self._gate(_meta(request), context)
        return self._answer(status="ok")

    async def rpc_decline(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """A partner will not take part in a mix this replica pushed to it."""
        meta = _meta(request)
        sender = self._gate(meta, context)
        mix = self.open.get(int(meta.get("index", -1)))
        if mix is not None and sender in mix.partners and sender not in mix.got:
            mix.declined.add(sender)
            mix.errors[sender] = "declined"
            mix.changed.set()
        return self._answer(status="ok")

    # ---- stage state for joining workers -----------------------------------------------------------

    async def rpc_state(self, request: runtime_pb2.ExpertRequest,
                        context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """This replica's stage state (:func:`agoractl.runtime.join.pack_state`): metadata, then the tensors."""
        self._gate(_meta(request), context)
        if self.state_provider is None:
            yield self._answer(ready=False)
            return
        meta, tensors = await self.loop.run_in_executor(None, self.state_provider)
        yield self._answer(ready=True, state=meta, tensors=len(tensors))
        for tensor in tensors:
            serialized = wire_compression("fp32").compress(tensor, CompressionInfo.from_tensor(tensor))
            for part in split_for_streaming(serialized, self.chunk_bytes):
                yield runtime_pb2.ExpertResponse(tensors=[part])

    async def _download(self, peer: str) -> Optional[tuple[dict, list[torch.Tensor]]]:
        request = runtime_pb2.ExpertRequest(metadata=MSGPackSerializer.dumps({"cred": self.token()}))
        stream = await self._stub(peer).rpc_state(request)
        head = await stream.__anext__()
        self._check_callee(head, peer)
        meta = _meta(head)
        if not meta.get("ready"):
            return None
        tensors, parts = [], []
        async for message in stream:
            parts.append(message.tensors[0])
            if len(parts) == parts[0].chunks:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
        if len(tensors) != int(meta["tensors"]):
            raise ValueError(f"state of {meta['tensors']} tensors; {len(tensors)} came")
        return dict(meta["state"], ready=True), tensors

    def load_stage_state(self, timeout: float = 60.0) -> Optional[tuple[dict, list[torch.Tensor]]]:
        """The stage state from the first live replica that serves it (:attr:`state_sources` order); None when
        none did within `timeout`."""
        deadline = time.monotonic() + timeout
        for peer in self.state_sources():
            if peer == self.peer or time.monotonic() >= deadline:
                continue
            try:
                found = self._call(self._download(peer), max(1.0, deadline - time.monotonic()))
            except Exception:
                continue
            if found is not None:
                return found
        return None


async def _aiter(items):
    for item in items:
        yield item


async def _daemon_maddr(_dht, node):
    return node.p2p.daemon_listen_maddr


def direct_mixing(run, stage: str, dht, peers, size: int, admitted=None) -> DirectMixing:
    """The direct transport of a worker of `stage` on the node's `dht` (its own P2P replica of the node's
    daemon), set from ``data_parallel.fgdiloco``; `peers`: the stage's :class:`StagePeers` (live replicas);
    `admitted`: the node's :class:`~agoractl.runtime.admission.Admitted` when admission is on."""
    from agoractl.runtime.transport import namespace  # the stage RPCs' naming, shared

    fg, me = run.data_parallel.fgdiloco, dht.peer_id.to_base58()
    maddr = dht.run_coroutine(_daemon_maddr)

    def sources() -> list[str]:  # the stage's operators serve its state (as hivemind's averager shares it)
        workers = peers.records.stage_workers(stage)
        return sorted(p for p, rec in workers.items() if p != me and getattr(rec, "role", None) == "operator")

    gate = admitted.auth.gate_replica(stage) if admitted is not None else None
    return DirectMixing(lambda: P2P.replicate(maddr), f"{namespace(run.metadata.name, stage)}.mix", peers.live_ids,
                        size=size, deadline_s=fg.matchmaking_timeout_s + fg.allreduce_timeout_s,
                        send_timeout_s=fg.allreduce_timeout_s, wire_dtype=fg.wire_dtype, chunk_bytes=fg.chunk_bytes,
                        gate=gate, token=(admitted.current if admitted is not None else lambda: None),
                        state_sources=sources, startup_timeout_s=run.network.startup_timeout_s)
