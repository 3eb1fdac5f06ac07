"""The Authorizer's live state: join queue, rate limiter, capacity counters and live policy.

:class:`RedisState` keeps them in Redis under one key prefix (so several Authorizer processes, or a restarted
one, share them); :class:`MemoryState` keeps them in this process (the embedded default). Both give the same
contract: ``admission_lock()`` serialises admissions, so no two requests take the last free slot.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Iterator, Optional

import redis

from agoractl.errors import RuntimeFailure


class MemoryState:
    """Everything in this process; lost on restart (the queue is rebuilt from the database)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._queue: dict[str, float] = {}
        self._next_join = 0.0
        self._capacity: dict[str, int] = {}
        self._policy: Optional[str] = None
        self._seq = 0

    @contextlib.contextmanager
    def admission_lock(self) -> Iterator[None]:
        with self._lock:
            yield

    def now(self) -> float:
        return time.time()

    def enqueue(self, node_id: str, at: float) -> None:
        with self._lock:
            self._queue.setdefault(node_id, at)

    def dequeue(self, node_id: str) -> None:
        with self._lock:
            self._queue.pop(node_id, None)

    def position(self, node_id: str) -> Optional[int]:
        with self._lock:
            if node_id not in self._queue:
                return None
            return sorted(self._queue, key=lambda n: (self._queue[n], n)).index(node_id)

    def queue_length(self) -> int:
        return len(self._queue)

    def take_join_slot(self, per_minute: float) -> float:
        """0 when a join may go ahead now (and takes the slot), else seconds until the next one may."""
        with self._lock:
            now = self.now()
            if now < self._next_join:
                return self._next_join - now
            self._next_join = now + 60.0 / per_minute
            return 0.0

    def set_capacity(self, counts: dict[str, int]) -> None:
        with self._lock:
            self._capacity = dict(counts)

    def capacity(self) -> dict[str, int]:
        return dict(self._capacity)

    def get_policy(self) -> Optional[str]:
        return self._policy

    def set_policy(self, text: str) -> None:
        self._policy = text

    def close(self) -> None:
        pass


class RedisState:
    """The same contract in Redis under PREFIX (a sorted set for the queue, a lock for admissions)."""

    def __init__(self, url: str, prefix: str) -> None:
        try:
            self.r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=10)
            self.r.ping()
        except (redis.RedisError, ValueError) as e:
            raise RuntimeFailure(f"AGORA_REDIS_URL {url}: {e}",
                                 hint="check the URL (redis://host:6379/0) and that Redis is running") from None
        self.p = prefix
        self._local = threading.Lock()

    @contextlib.contextmanager
    def admission_lock(self) -> Iterator[None]:
        """This process's threads queue on a local lock; one at a time then takes the Redis lock (shared with
        other Authorizer processes on the same prefix)."""
        with self._local, self.r.lock(self.p + "admit", timeout=30, sleep=0.005, blocking_timeout=60,
                                      thread_local=False):
            yield

    def now(self) -> float:
        s, us = self.r.time()
        return s + us / 1e6

    def enqueue(self, node_id: str, at: float) -> None:
        self.r.zadd(self.p + "queue", {node_id: at}, nx=True)

    def dequeue(self, node_id: str) -> None:
        self.r.zrem(self.p + "queue", node_id)

    def position(self, node_id: str) -> Optional[int]:
        return self.r.zrank(self.p + "queue", node_id)

    def queue_length(self) -> int:
        return self.r.zcard(self.p + "queue")

    def take_join_slot(self, per_minute: float) -> float:
        """Call under admission_lock: 0 and the slot taken, or seconds until the next join may go ahead."""
        now = self.now()
        nxt = float(self.r.get(self.p + "next_join") or 0.0)
        if now < nxt:
            return nxt - now
        self.r.set(self.p + "next_join", repr(now + 60.0 / per_minute))
        return 0.0

    def set_capacity(self, counts: dict[str, int]) -> None:
        pipe = self.r.pipeline()
        pipe.delete(self.p + "capacity")
        if counts:
            pipe.hset(self.p + "capacity", mapping=counts)
        pipe.execute()

    def capacity(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.r.hgetall(self.p + "capacity").items()}

    def get_policy(self) -> Optional[str]:
        return self.r.get(self.p + "policy")

    def set_policy(self, text: str) -> None:
        self.r.set(self.p + "policy", text)

    def close(self) -> None:
        self.r.close()


def policy_json(obj) -> str:
    return json.dumps(obj, sort_keys=True)
