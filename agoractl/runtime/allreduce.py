"""One round's butterfly all-reduce, instrumented (the averaging transport's engine,
:mod:`agoractl.runtime.averaging`): hivemind's ``AllReduceRunner`` counting the bytes in and out, the share
of the values due from senders that arrived (reduce success), the values this peer reduced with no groupmate's
part (not mixed, :meth:`StageAllReduce.unmixed_ranges`), dropping a groupmate's invalid part
(``validation.part_multiple``), failed reducers' parts marked not averaged, and preemption points for fault
drills. Also the bf16 wire and the bytes a complete round should move."""

from __future__ import annotations

import asyncio
from types import MethodType
from typing import AsyncIterator, Callable, Optional

import numpy as np
import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import BannedException
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression, deserialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2

from agoractl import logs
from agoractl.algorithms.validation import part_problem, rms

class BFloat16Wire(CompressionBase):
    """Values travel as bfloat16 (2 bytes); read back by hivemind's plain deserializer as bf16."""

    compression_type = runtime_pb2.CompressionType.NONE

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        half = tensor.detach().to(torch.bfloat16).contiguous()
        return runtime_pb2.Tensor(compression=self.compression_type, buffer=half.view(torch.int16).numpy().tobytes(),
                                  size=half.shape, dtype="bfloat16", requires_grad=False)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return NoCompression().extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 2.0 / torch.empty(0, dtype=info.descriptor.dtype).element_size()


def wire_compression(wire_dtype: str) -> CompressionBase:
    """The hivemind compression for a method's ``wire_dtype`` (``data_parallel.<method>.wire_dtype``)."""
    return BFloat16Wire() if wire_dtype == "bf16" else NoCompression()


def expected_round_bytes(payload_bytes: float, senders: int, reducers: int, is_reducer: bool) -> float:
    """Bytes a peer sends plus receives in one complete round of the butterfly all-reduce.

    Every sender streams each reducer its 1/reducers share of the payload and gets the same amount
    back; a reducer also takes the share of every other sender and returns it. A contributor
    (never a reducer) thus moves 2 x payload; an operator 2 x payload x ((R-1)/R + (S-1)/R).
    """
    share = payload_bytes / reducers
    own = payload_bytes - (share if is_reducer else 0.0)
    served = share * (senders - 1) if is_reducer else 0.0
    return 2.0 * (own + served)


def _mark_failed_reducer(container, peer_index: int) -> None:
    """Replacement of TensorPartContainer.register_failed_reducer: the parts a failed reducer did not
    return come back as NaN (not averaged) instead of a zero delta, so the worker can tell them apart
    from values that averaged to exactly their local value."""
    start, stop = container._outputs_registered_by_peer[peer_index], container.num_parts_by_peer[peer_index]
    for part_index in range(start, stop):
        part = container._input_parts_by_peer[peer_index][part_index][0]
        container.register_processed_part(peer_index, part_index, torch.full_like(part, float("nan")))
        container.failed_size += part.numel()


class _CountingStub:
    """A stub for rpc_aggregate_part whose reply stream counts the bytes it brings in."""

    def __init__(self, stub, runner: "StageAllReduce"):
        self._stub, self._runner = stub, runner

    async def rpc_aggregate_part(self, requests, timeout: Optional[float] = None):
        stream = await self._stub.rpc_aggregate_part(requests)
        return self._runner.count_in(stream)


class StageAllReduce(AllReduceRunner):
    """hivemind's butterfly all-reduce, instrumented: bytes in and out, reduce success, fault injection."""

    def __init__(self, *, wire: CompressionBase, fault: Optional[str], on_fault: Callable[[str], None],
                 part_multiple: Optional[float] = None, **kwargs):
        super().__init__(**kwargs)
        self.wire, self.fault, self.on_fault = wire, fault, on_fault
        self.bytes_sent = self.bytes_received = self.dropped_parts = 0
        if part_multiple is not None:  # a groupmate's invalid part is dropped like a missing one
            own = rms(self.tensor_part_container.local_tensors[0])
            accumulate = self.tensor_part_reducer.accumulate_part

            async def checked(sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0):
                problem = part_problem(tensor_part, own, part_multiple)
                if problem is not None:
                    self.dropped_parts += 1
                    logs.get("averaging").warning("averaging part dropped", sender=sender_index, problem=problem)
                    # Banned once, through the runner: a second on_sender_failed dropped an honest sender's part.
                    await self._ban_sender(self.sender_peer_ids[sender_index])
                    raise BannedException(problem)
                return await accumulate(sender_index, part_index, tensor_part, weight)

            self.tensor_part_reducer.accumulate_part = checked
        self._serving = 0
        self._served = asyncio.Event()
        self._served.set()
        self.tensor_part_container.register_failed_reducer = MethodType(_mark_failed_reducer,
                                                                        self.tensor_part_container)
        mine = self.ordered_peer_ids.index(self.peer_id)  # the parts go to the reducers in order, contiguous
        self._slice_start = sum(int(item[0].numel()) for i in range(mine)
                                for item in self.tensor_part_container._input_parts_by_peer[i])

    def _maybe_fault(self, point: str) -> None:
        if self.fault == point:
            self.on_fault(point)

    def _get_peer_stub(self, peer):
        return _CountingStub(super()._get_peer_stub(peer), self)

    async def count_in(self, stream: AsyncIterator[averaging_pb2.AveragingData]):
        async for msg in stream:
            self.bytes_received += msg.ByteSize()
            yield msg

    async def _generate_input_for_peer(self, peer_index: int):
        async for msg in super()._generate_input_for_peer(peer_index):
            self.bytes_sent += msg.ByteSize()
            yield msg
            # Resumed: the chunk went out and the transport asks for the next one.
            self._maybe_fault("send")

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        self._serving += 1
        self._served.clear()
        try:
            async for msg in super()._accumulate_parts_streaming(self.count_in(stream), sender_index):
                if isinstance(self.wire, BFloat16Wire) and msg.code == averaging_pb2.AVERAGED_PART:
                    # hivemind answers in the sender's format (fp32 after bf16 decoding): re-encode.
                    delta = deserialize_torch_tensor(msg.tensor_part)
                    msg = averaging_pb2.AveragingData(code=msg.code, tensor_part=self.wire.compress(
                        delta, CompressionInfo.from_tensor(delta)))
                # A preempted reducer dies with its first averaged chunk reduced but not returned.
                self._maybe_fault("reduce")
                self.bytes_sent += msg.ByteSize()
                yield msg
        finally:
            self._serving -= 1
            if self._serving == 0:
                self._served.set()

    async def wait_served(self, timeout: Optional[float]) -> None:
        """Wait until every sender that streamed to this reducer got its results (bounded)."""
        try:
            await asyncio.wait_for(self._served.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def unmixed_ranges(self) -> list[tuple[int, int]]:
        """[start, stop) ranges of the flat values this peer reduced where no groupmate's part arrived (each one
        failed or was dropped first): reduced from this peer's values alone, they come back finite - a zero
        delta - yet nothing was mixed, so they must not count as averaged. (A lone reducer whose only
        groupmate vanished recorded success 1.0 on 0 bytes received.)"""
        reducer = self.tensor_part_reducer
        me = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None
        others = [min(got, failed) for i, (got, failed) in
                  enumerate(zip(reducer.num_parts_received, reducer.sender_failed_after)) if i != me]
        out, start = [], self._slice_start
        for index, shape in enumerate(reducer.part_shapes):
            size = int(np.prod(shape))
            if not any(n > index for n in others):
                out.append((start, start + size))
            start += size
        return out

    def reduce_counts(self) -> tuple[int, int]:
        """(values due from senders, values that arrived) for the slice this peer reduces."""
        reducer = self.tensor_part_reducer
        sizes = [int(np.prod(s)) for s in reducer.part_shapes]
        if not sizes or reducer.num_senders == 0:
            return 0, 0
        prefix = np.concatenate([[0], np.cumsum(sizes)])
        received = 0
        for got, failed_after in zip(reducer.num_parts_received, reducer.sender_failed_after):
            received += int(prefix[int(min(got, failed_after, len(sizes)))])
        return int(prefix[-1]) * reducer.num_senders, received
