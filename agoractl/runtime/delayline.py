"""A user-space delay line: a TCP relay in front of a node that delays every byte by half the path's RTT.

This kernel has no ``netem``, so round-trip time is emulated here, in the emulated host's own network
namespace (:mod:`agoractl.runtime.hosts`). The node listens on its host address at
:data:`~agoractl.runtime.hosts.NODE_PORT` and announces :data:`~agoractl.runtime.hosts.PUBLIC_PORT`, where this
relay listens: every connection to the node, whoever dials, passes through the relay of the host dialled.
The relay knows the dialler by its source address and looks up the dialler's access-link RTT in a table
the launcher keeps (JSON ``{address: rtt_ms}``, re-read when it changes); the path's RTT is the sum of both
hosts' RTTs, and each direction's bytes are held for half of it, in order, before they are passed on.
Bandwidth is not the relay's business: ``tc tbf`` on the veths shapes the bytes it sends and receives.

What it does not emulate: the dialler's TCP sees acknowledgements from the relay, not from the far end, so
TCP's own reaction to a long RTT (slow start, the congestion window) is absent; a window-limited transfer is
faster than on a real long link. ICMP (``ping``) is not delayed. Run as
``python -m agoractl.runtime.delayline --listen ADDR:PORT --to ADDR:PORT --rtt-ms R --table FILE``; it prints
``ready`` once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
from typing import Optional

CHUNK = 256 * 1024
QUEUE_LIMIT = 16 * 1024 * 1024
"""Bytes one direction may hold before the relay stops reading (back-pressure on the sender)."""


class Lead:
    """How much earlier than due to wake up, so that the *median* wake-up is on time: a loaded machine wakes a
    sleeping process late, by a few ms typically and by tens now and then. A stochastic median tracker (a
    step of :data:`STEP` s towards each lateness's sign), learnt across every connection of this relay;
    spikes do not drag it as they would a mean."""

    value = 0.0
    STEP = 0.0002
    MAX = 0.010

    @classmethod
    def learn(cls, late_s: float) -> None:
        cls.value = min(cls.MAX, max(0.0, cls.value + (cls.STEP if late_s > 0 else -cls.STEP)))


class Table:
    """The hosts' RTTs by address, re-read from the launcher's file when its modification time changes."""

    def __init__(self, path: Optional[str]):
        self.path, self.mtime, self.rtts = path, None, {}

    def rtt_ms(self, address: str) -> float:
        if self.path:
            try:
                mtime = os.stat(self.path).st_mtime_ns
                if mtime != self.mtime:
                    with open(self.path) as f:
                        self.rtts, self.mtime = {str(k): float(v) for k, v in json.load(f).items()}, mtime
            except (OSError, ValueError):
                pass
        return float(self.rtts.get(address, 0.0))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy `reader` to `writer`, each chunk `delay_s` after it arrived; EOF is passed on the same way."""
    loop = asyncio.get_running_loop()
    if delay_s <= 0:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        return
    queue: collections.deque = collections.deque()
    queued = [0]
    arrived, drained = asyncio.Event(), asyncio.Event()

    async def read() -> None:
        try:
            while True:
                data = await reader.read(CHUNK)
                queue.append((loop.time() + delay_s, data))
                queued[0] += len(data)
                arrived.set()
                if not data:
                    return
                while queued[0] > QUEUE_LIMIT:
                    drained.clear()
                    await drained.wait()
        except (ConnectionError, OSError):
            queue.append((loop.time(), b""))
            arrived.set()

    async def write() -> None:
        while True:
            while not queue:
                arrived.clear()
                await arrived.wait()
            due, data = queue.popleft()
            wait = due - loop.time() - Lead.value
            if wait > 0:
                await asyncio.sleep(wait)
                Lead.learn(loop.time() - due)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            queued[0] -= len(data)
            drained.set()

    reading = asyncio.ensure_future(read())
    try:
        await write()
    finally:
        reading.cancel()


async def _serve(listen: tuple[str, int], to: tuple[str, int], rtt_ms: float, table: Table) -> None:
    async def handle(c_reader, c_writer):
        peer = (c_writer.get_extra_info("peername") or ("",))[0]
        delay_s = (rtt_ms + table.rtt_ms(peer)) / 2000.0
        try:
            n_reader, n_writer = await asyncio.open_connection(*to)
        except OSError:
            c_writer.close()
            return
        try:
            await asyncio.gather(_pipe(c_reader, n_writer, delay_s), _pipe(n_reader, c_writer, delay_s))
        except (ConnectionError, OSError):
            pass
        finally:
            for w in (n_writer, c_writer):
                w.close()

    server = await asyncio.start_server(handle, *listen, backlog=256)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agoractl.runtime.delayline", description=__doc__.splitlines()[0])
    p.add_argument("--listen", required=True, help="ADDR:PORT to accept connections on")
    p.add_argument("--to", required=True, help="ADDR:PORT of the node behind the relay")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="this host's access-link RTT, in ms")
    p.add_argument("--table", default=None, help="JSON file {address: rtt_ms} of the other hosts")
    a = p.parse_args(argv)
    try:
        asyncio.run(_serve(_addr(a.listen), _addr(a.to), a.rtt_ms, Table(a.table)))
    except KeyboardInterrupt:
        return 0
    except OSError as e:
        print(f"error: delay line on {a.listen}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
