"""A trainer's data path as a process, for tests of the shard ledger across processes
(tests/data/test_claim_processes.py): ``python -m tests.data.claim_reader LOG TRAINER IN_FLIGHT DELAY_S
--set ...``.

It opens the trainer stream (claims in data.output) as a trainer does (sequences stay in flight until
settled), keeps up to IN_FLIGHT sequences in flight, and completes the oldest every DELAY_S seconds on
another thread (as a trainer's other pipelines do): settle, write to the ledger, then append ``done SHARD EPOCH OFFSET`` to LOG (flushed and fsynced, so
a SIGKILL leaves exactly the completed ones in it). Each drawn sequence is first logged as
``drawn ...``. Ends with ``end EPOCHS_DONE``.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

from agoractl.data.stream import trainer_stream
from agoractl.manifest.loader import load_manifest
from tests.conftest import MANIFESTS


def main(argv: list[str]) -> None:
    log_path, trainer, in_flight, delay = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    run = load_manifest(MANIFESTS / "local-cpu.yaml", sets)
    log = open(log_path, "a")

    def write(line: str) -> None:
        log.write(line + "\n")
        log.flush()
        os.fsync(log.fileno())

    stream = trainer_stream(run, trainer, poll_s=0.1)
    stream.claims.track = True
    flying: collections.deque = collections.deque()
    slots = threading.Semaphore(in_flight)
    finished = threading.Event()

    def completer() -> None:  # another pipeline: completes the oldest sample in flight every DELAY_S
        while not (finished.is_set() and not flying):
            if not flying:
                time.sleep(0.01)
                continue
            time.sleep(delay)
            shard, epoch, offset = flying.popleft()
            stream.settle(shard, epoch, offset)
            stream.flush()
            write(f"done {shard} {epoch} {offset}")
            slots.release()

    worker = threading.Thread(target=completer, daemon=True)
    worker.start()
    while True:
        slots.acquire()  # at most IN_FLIGHT drawn and not completed
        if next(stream, None) is None:
            break
        write("drawn {} {} {}".format(*stream.last))
        flying.append(stream.last)
    finished.set()
    worker.join()
    stream.flush()
    write(f"end {stream.claims.epochs_done}")


if __name__ == "__main__":
    main(sys.argv[1:])
