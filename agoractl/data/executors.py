"""Where re-sharding's tasks run: ``local`` (threads of this process) or ``dask`` (a Dask distributed cluster).

Both run the same task functions on the same arguments and return results in task order, so the
output does not depend on the executor or on the number of workers. A task's known error comes back
as one line (``("error", message, hint)``) and stops the job; a worker lost mid-task (killed,
preempted, out of memory) is the cluster's business: Dask's scheduler reruns the task elsewhere,
which is safe because every task writes to a temporary name or a whole-object upload and is
idempotent (``docs/sharding.md`` says why Dask and not Ray).
"""

from __future__ import annotations

import os
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, Callable, Optional, Protocol

from agoractl.errors import AgoraError, RuntimeFailure, UsageError

Progress = Callable[[str, int, int], None]
"""progress(phase, tasks done, tasks in the phase); once before the passes, progress("input", bytes, bytes)
with the bytes of input that each pass goes through (for a rate in MB/s)."""

ADDRESS_ENV = "DASK_SCHEDULER_ADDRESS"
"""Dask's own variable for the scheduler (its config key ``scheduler-address``)."""
EXECUTORS = ("local", "dask")


def run_task(fn: Callable, *args: Any) -> tuple:
    """Run one task; an unexpected error becomes one line naming it (AGORA_DEBUG=1 shows the traceback)."""
    if os.environ.get("AGORA_DEBUG") == "1":
        return ("ok", fn(*args))
    try:
        return ("ok", fn(*args))
    except AgoraError as e:
        return ("error", e.message, e.hint)
    except Exception as e:
        text = str(e).splitlines()[0] if str(e) else ""
        return ("error", f"{type(e).__name__}: {text}", "rerun with AGORA_DEBUG=1 and --jobs 1 for the traceback")


class Executor(Protocol):
    workers: int

    def map(self, fn: Callable, shared: Any, tasks: list[tuple], phase: str,
            progress: Optional[Progress]) -> list[Any]:
        """``fn(shared, *args)`` for every ``args`` in `tasks`; the results in task order."""

    def close(self) -> None: ...


class _Collector:
    """Results in task order, progress as they arrive, the first error raised."""

    def __init__(self, n: int, phase: str, progress: Optional[Progress]):
        self.results: list[Any] = [None] * n
        self.done, self.n, self.phase, self.progress = 0, n, phase, progress
        if progress:
            progress(phase, 0, n)

    def take(self, i: int, out: tuple) -> None:
        if out[0] == "error":
            raise RuntimeFailure(out[1], hint=out[2])
        self.results[i] = out[1]
        self.done += 1
        if self.progress:
            self.progress(self.phase, self.done, self.n)


class LocalExecutor:
    """Threads, not processes: the heavy work (parquet decoding and encoding, gathers, IPC, hashing,
    batch tokenization) runs in Arrow's and the tokenizers' native code with the GIL released, so
    threads use every core without forking, pickling, or warming a fresh allocator per process."""

    def __init__(self, jobs: int):
        self.workers = max(1, jobs)
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="agora-shard") if jobs > 1 else None

    def map(self, fn: Callable, shared: Any, tasks: list[tuple], phase: str,
            progress: Optional[Progress]) -> list[Any]:
        out = _Collector(len(tasks), phase, progress)
        if self.pool is None or len(tasks) <= 1:
            for i, args in enumerate(tasks):
                out.take(i, run_task(fn, shared, *args))
            return out.results
        futures = {self.pool.submit(run_task, fn, shared, *args): i for i, args in enumerate(tasks)}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                try:
                    out.take(futures[f], f.result())
                except BaseException:
                    for p in pending:
                        p.cancel()
                    raise
        return out.results

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


class DaskExecutor:
    """Tasks on a Dask distributed cluster: one per unit, then one per shard, spread by its scheduler.

    The shared configuration is sent to the workers once (scattered); each task's own arguments are
    small (a unit's coordinates, a shard's pieces). A task whose worker dies is rerun by the
    scheduler (``distributed.scheduler.allowed-failures``, 3 by default); one that raises is retried
    ``retries`` times, then its error stops the job, and a rerun keeps everything finished.
    """

    def __init__(self, address: str, retries: int = 2, connect_timeout_s: float = 10, wait_workers_s: float = 60):
        try:
            from distributed import Client  # an optional extra: imported only when asked for
        except ImportError:
            raise RuntimeFailure("--executor dask needs Dask distributed, which is not installed",
                                 hint="pip install 'agoractl[dask]'")
        try:
            self.client = Client(address, timeout=f"{connect_timeout_s}s", set_as_default=False)
        except (OSError, TimeoutError, ValueError) as e:
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise RuntimeFailure(f"--address {address}: cannot reach the Dask scheduler ({text[:160]})",
                                 hint="start one (`dask scheduler`, then `dask worker ADDRESS` on each machine) "
                                      "or fix --address / " + ADDRESS_ENV)
        try:
            self.client.wait_for_workers(1, timeout=wait_workers_s)
        except (TimeoutError, OSError):
            self.client.close()
            raise RuntimeFailure(f"--address {address}: the Dask cluster has no workers after {wait_workers_s:.0f} s",
                                 hint="start workers with `dask worker " + address + "`")
        self.address = address
        self.retries = retries
        self.workers = len(self.client.scheduler_info()["workers"])
        self.token = uuid.uuid4().hex[:8]

    def map(self, fn: Callable, shared: Any, tasks: list[tuple], phase: str,
            progress: Optional[Progress]) -> list[Any]:
        from distributed import as_completed

        out = _Collector(len(tasks), phase, progress)
        if not tasks:
            return out.results
        on_workers = self.client.scatter(shared, broadcast=True, hash=False)  # sent once, not per task
        futures = [self.client.submit(run_task, fn, on_workers, *args, key=f"agora-{phase}-{k}-{self.token}",
                                      retries=self.retries, pure=False)
                   for k, args in enumerate(tasks)]
        index = {f.key: k for k, f in enumerate(futures)}
        try:
            for f in as_completed(futures, loop=self.client.loop):
                try:
                    result = f.result()
                except Exception as e:  # the task died with its workers too often, or the cluster went away
                    if os.environ.get("AGORA_DEBUG") == "1":
                        raise
                    text = str(e).splitlines()[0] if str(e) else type(e).__name__
                    raise RuntimeFailure(f"{phase} task {index[f.key]} failed on the Dask cluster ({text[:160]})",
                                         hint="rerun the same command: finished units and shards are kept")
                out.take(index[f.key], result)
        finally:
            self.client.cancel([f for f in futures if not f.done()])
        return out.results

    def close(self) -> None:
        self.client.close()


def make_executor(kind: str, jobs: int = 1, address: Optional[str] = None) -> Executor:
    if kind == "local":
        return LocalExecutor(jobs)
    if kind == "dask":
        address = address or os.environ.get(ADDRESS_ENV)
        if not address:
            raise UsageError("--executor dask needs the scheduler: --address tcp://HOST:8786 or " + ADDRESS_ENV,
                             hint="start one with `dask scheduler` (and `dask worker tcp://HOST:8786` per machine)")
        return DaskExecutor(address)
    raise UsageError(f"--executor must be one of {', '.join(EXECUTORS)}; got {kind!r}")
