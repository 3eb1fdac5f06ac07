"""Measure an emulated link (:mod:`agoractl.runtime.hosts`): round-trip time and throughput over TCP.

``python -m agoractl.runtime.linkprobe serve ADDR:PORT`` answers each 1-byte ping with a byte and, after a
``B`` byte, sinks a bulk transfer and replies with the bytes it counted and the seconds from its first to
its last byte (the receiver's view: the sender's socket buffers do not inflate the rate). ``probe
ADDR:PORT`` prints one JSON object: ``rtt_ms`` (median of ``--pings`` round trips), ``throughput_mbps``
(``--seconds`` of bulk data). Both run inside the hosts' namespaces (``ip netns exec``); the path is the
one the nodes use: tbf on the veths, the delay line in front of the server.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import sys
import time

CHUNK = 64 * 1024


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError("closed")
        data += part
    return data


def serve(addr: tuple[str, int]) -> None:
    srv = socket.create_server(addr, reuse_port=True)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            try:
                while True:
                    b = _recv_exact(conn, 1)
                    if b == b"P":
                        conn.sendall(b"p")
                        continue
                    (total,) = struct.unpack("!Q", _recv_exact(conn, 8))
                    got, first, last = 0, None, None
                    while got < total:
                        part = conn.recv(min(CHUNK, total - got))
                        if not part:
                            raise ConnectionError("closed")
                        last = time.perf_counter()
                        first = first or last
                        got += len(part)
                    conn.sendall(struct.pack("!Qd", got, (last or 0) - (first or 0)))
            except ConnectionError:
                pass


def probe(addr: tuple[str, int], pings: int = 20, seconds: float = 3.0, mbps_hint: float = 1000.0) -> dict:
    """RTT and throughput to a ``serve`` at `addr`; `mbps_hint` sizes the transfer to about `seconds`."""
    conn = socket.create_connection(addr, timeout=60)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(pings):
        t = time.perf_counter()
        conn.sendall(b"P")
        _recv_exact(conn, 1)
        rtts.append((time.perf_counter() - t) * 1000)
    total = int(mbps_hint * 1e6 / 8 * seconds)
    conn.sendall(b"B" + struct.pack("!Q", total))
    block, sent = b"\0" * CHUNK, 0
    while sent < total:
        n = min(CHUNK, total - sent)
        conn.sendall(block[:n])
        sent += n
    got, span = struct.unpack("!Qd", _recv_exact(conn, 16))
    conn.close()
    return {"rtt_ms": round(statistics.median(rtts), 2), "rtt_ms_min": round(min(rtts), 2),
            "throughput_mbps": round(got * 8 / span / 1e6, 2) if span > 0 else None,
            "bytes": got, "seconds": round(span, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m agoractl.runtime.linkprobe", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("addr")
    c = sub.add_parser("probe")
    c.add_argument("addr")
    c.add_argument("--pings", type=int, default=20)
    c.add_argument("--seconds", type=float, default=3.0)
    c.add_argument("--mbps-hint", type=float, default=1000.0, help="expected Mbit/s: sizes the transfer")
    a = p.parse_args(argv)
    if a.cmd == "serve":
        serve(_addr(a.addr))
        return 0
    print(json.dumps(probe(_addr(a.addr), a.pings, a.seconds, a.mbps_hint)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
