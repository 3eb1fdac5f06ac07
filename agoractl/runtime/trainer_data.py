"""A trainer's data side (:class:`~agoractl.runtime.trainer.Trainer` inherits it): its sample stream, the
microbatches it draws, the sequences it settles in the shard ledger, the data positions it records at
checkpoint steps (a resumed run reads on from there) and its consumption reports. The stream's reads and
ledger writes run on the trainer's data thread (``_data_pool``), never on its event loop."""

from __future__ import annotations

import asyncio
from typing import Optional

import torch


class TrainerData:
    """The data methods of a trainer; the attributes they use (run, index, t, stages, records, positions,
    draws, samples_drawn, resume_step, stop, log, _stream, _data_pool, seen_step, finished) are the Trainer's."""

    def _open_stream(self):
        if self._stream is None:
            from agoractl.data.stream import trainer_stream

            position = None
            if self.positions is not None:
                try:  # a trainer restarted in a running swarm reads on; it does not go back to the checkpoint
                    running = any(p.step > self.resume_step for s in self.stages
                                  for p in self.records.stage_progress(s).values())
                except Exception:
                    running = False
                position, source = self.positions.position_for(self.resume_step, running)
                self.resumed = {"step": self.resume_step, "source": source}
                self.log.info("data position", **self.resumed)
            self._stream = trainer_stream(self.run, self.index, position, interrupt=self.stop.is_set)
            self._stream.interrupt = lambda: self.stop.is_set() or self.finished()
            if getattr(self._stream, "claims", None) is not None:
                self._stream.claims.track = True  # samples count as read once they complete
        return self._stream

    def _draw(self) -> Optional[tuple[torch.Tensor, list, Optional[int], int]]:
        """The next microbatch of trainers.microbatch samples [m, seq_len+1] (fewer at the end of the data),
        the samples' [shard, epoch, offset] when trainers.record_sequences, its draw number, and the index of its
        first sample among those this trainer drew (what :class:`~agoractl.algorithms.routing.ReplicaRoute`
        routes by; draws run one at a time, in order, on the data thread)."""
        draw = self.draws.drawn(self._stream.position()) if self.draws and hasattr(self._stream, "position") else None
        drawn, ids = [], []
        for _ in range(self.t.microbatch):
            s = next(self._stream, None)
            if s is None:
                break
            drawn.append(s)
            if getattr(self._stream, "last", None) is not None:
                ids.append(list(self._stream.last))
        if not drawn:
            return None
        self.samples_drawn += len(drawn)
        return torch.stack(drawn), ids, draw, self.samples_drawn - len(drawn)

    def _draw_ahead(self) -> None:
        """Start drawing the first microbatches (one per pipeline) on the data thread while the trainer still waits
        for workers: the first reads of a shard (claim, open, decode) then cost nothing once training begins."""
        if self._ahead is None:
            loop = asyncio.get_running_loop()
            self._ahead = [loop.run_in_executor(self._data_pool, self._draw) for _ in range(self.t.in_flight)]

    async def _next_draw(self) -> Optional[tuple[torch.Tensor, list, Optional[int], int]]:
        """The next microbatch (:meth:`_draw`): those drawn ahead first, in order."""
        if self._ahead:
            return await self._ahead.pop(0)
        return await asyncio.get_running_loop().run_in_executor(self._data_pool, self._draw)

    def _settle(self, seq_ids: list, completed: bool) -> None:
        """Completed (or given up): noted at once (a reader waiting at the epoch's end flushes it), then written
        to the shard ledger on the data thread; logged with trainers.record_sequences (a killed trainer's record)."""
        if self.t.record_sequences:
            self.log.info("sequences settled", sequences=seq_ids, completed=completed)
        for shard, epoch, offset in seq_ids:
            self._stream.settle(shard, epoch, offset)

    async def _mark_checkpoint(self) -> None:
        """Record the data position the first time every stage reached a checkpoint step."""
        step = self.positions.due(min(self.seen_step.values())) if self.positions is not None else None
        if step is not None and hasattr(self._stream, "position"):
            try:
                await asyncio.get_running_loop().run_in_executor(self._data_pool, self.positions.record, step,
                                                                 self._stream, self.draws)
            except Exception as e:  # a resume would fall back to the last report; training goes on
                self.positions.last = max(self.positions.last, step)
                self.log.warning("data position not recorded", step=step, error=f"{type(e).__name__}: {e}")

    async def _report_data(self) -> None:
        if not hasattr(self._stream, "position"):
            return
        from agoractl.data.stream import report_progress

        try:
            await asyncio.get_running_loop().run_in_executor(self._data_pool, report_progress, self.run,
                                                             self.index, self._stream)
        except Exception as e:  # consumption reports are advisory; training goes on
            self.log.warning("data progress report failed", error=f"{type(e).__name__}: {e}")

