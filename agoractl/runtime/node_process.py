"""The processes ``launch swarm`` starts (:class:`Node`), as ordinary subprocesses or forked from the launcher
once it imported the node code (:func:`start`).

A node process spends most of its start-up importing torch, hivemind (scipy with it) and agoractl's runtime:
about 4.5 s of CPU each on this 2-core machine, and a swarm starts three or more at once, all before the
first optimizer step. ``launch swarm`` must import the same modules for its own DHT client anyway, so it
imports them once (:func:`warm`, while the DHT seed starts) and forks each of its first workers and trainers
from itself (:func:`fork_node`): the child runs the very same command line (``agoractl launch worker ...``)
in a fresh session, with its own environment, stdin and stdout on ``/dev/null`` and stderr on its log - what
``subprocess.Popen`` gave it, without the imports (``ps`` shows the launcher's command line, and a process name
such as ``agoractl-worker``). :class:`ForkedProcess` is the part of ``Popen`` the
swarm uses (``pid``, ``poll``, ``wait``, ``send_signal``, ``returncode``).

Forking is only safe before the launcher runs anything threaded that a child could inherit half-done (its
own DHT, the supervisor's restarts later on): the swarm forks its first nodes only, and a node started after
that (a restart, churn) is an ordinary subprocess. ``AGORA_FORK_NODES=0`` turns forking off (every node
an ordinary subprocess, as on emulated hosts, where each node runs inside its own network namespace).
"""

from __future__ import annotations

import atexit
import gc
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

FORK_ENV = "AGORA_FORK_NODES"
NODE_MODULES = ("torch", "torch._dynamo", "hivemind", "agoractl.runtime.worker_node", "agoractl.runtime.trainer")
"""What a worker or trainer imports before it trains (the bulk of its start-up; torch._dynamo comes with building
the model on the meta device and with torch.optim: 1.9 s of it)."""


def enabled() -> bool:
    """Forking is on unless ``AGORA_FORK_NODES=0``; never off the main thread (a test running a swarm in a
    thread of its own process has other threads, and state, that a child must not inherit)."""
    import threading

    return os.environ.get(FORK_ENV, "1") != "0" and threading.current_thread() is threading.main_thread()


def warm(modules: Sequence[str] = NODE_MODULES) -> None:
    """Import the node code in this process, then freeze it out of the garbage collector's sight: a forked child
    inherits it all, and collections in the child then skip the millions of imported objects."""
    import importlib

    for name in modules:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()


class ForkedProcess:
    """A forked node process, as much of :class:`subprocess.Popen` as the swarm uses."""

    def __init__(self, pid: int, args: Sequence[str]):
        self.pid, self.args = pid, list(args)
        self.returncode: Optional[int] = None
        self.stdout = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its code is lost
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass
class Node:
    """A process the swarm started."""

    name: str
    kind: str  # dht, worker, trainer, or a utility node (health, dashboard)
    proc: Union[subprocess.Popen, ForkedProcess]
    log_path: Path
    stats_path: Optional[Path] = None
    stage: Optional[str] = None
    exit_code: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.exit_code is None:
            self.exit_code = self.proc.poll()
        return self.exit_code

    def log_tail(self, lines: int = 5) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start(argv: Sequence[str], env: dict[str, str], log_path: Path, fork: bool,
          stdout=subprocess.DEVNULL) -> Union[subprocess.Popen, ForkedProcess]:
    """A node process in its own session (killed as a whole: :func:`signal_group`), stderr appended to `log_path`:
    forked from this process when `fork` (then stdout is /dev/null), else an ordinary subprocess."""
    if fork:
        return fork_node(argv, env, log_path)
    with open(log_path, "ab") as log:
        return subprocess.Popen(list(argv), stdout=stdout, stderr=log, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


def signal_group(pid: int, sig: int) -> None:
    """Send `sig` to the process group `pid` leads, if it is still there."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def started_at() -> float:
    """Wall-clock time this process started, to the clock tick. (psutil's ``create_time`` adds the boot time, which
    Linux gives in whole seconds: up to 1 s early, 0.8 s on this machine's boot.)"""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks since boot
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        import psutil

        return psutil.Process().create_time()


def fork_node(argv: Sequence[str], env: dict[str, str], log_path: Path) -> ForkedProcess:
    """Run ``agoractl`` with `argv` (``[python, -m, agoractl, launch, KIND, ...]``, as for a subprocess) in a
    forked child: its own session, environment `env`, stderr appended to `log_path`."""
    args = list(argv)
    if args[1:3] != ["-m", "agoractl"]:
        raise ValueError(f"only agoractl command lines can be forked; got {args[:3]}")
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:  # out of processes or memory: raised to the launcher, as Popen would
        os.close(log_fd)
        raise
    if pid:
        os.close(log_fd)
        return ForkedProcess(pid, args)
    _child(args[3:], env, log_fd)  # never returns


def _name(name: str) -> None:
    """The process name ``top`` and ``ps -o comm`` show (15 bytes at most); its command line stays the launcher's."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _own_exit_handlers() -> None:
    """Exit handlers of the child's own, as a fresh interpreter would have: none of the launcher's (they stop what
    the launcher started, or delete its temporary directories), and no claim on the launcher's multiprocessing
    children; then the ones every interpreter registers on import (logging's flush, multiprocessing's clean-up)."""
    import logging
    import multiprocessing.process
    import multiprocessing.util
    import weakref

    atexit._clear()
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        finalizer.atexit = False
    weakref.finalize._registered_with_atexit = False  # the child's own finalizers register afresh
    multiprocessing.process._children.clear()
    atexit.register(logging.shutdown)
    atexit.register(multiprocessing.util._exit_function)


def _child(args: list[str], env: dict[str, str], log_fd: int) -> None:
    """The forked child: a fresh session and stdio, then the command line; exits with its exit code (1 on an
    uncaught exception, whose traceback goes to its log) and never returns into the launcher's stack."""
    code, own_handlers = 1, False
    try:
        os.setsid()
        _name(f"agoractl-{args[1] if len(args) > 1 else 'node'}")
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.dup2(log_fd, 2)
        os.close(devnull)
        os.close(log_fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        # New stdio objects: a launcher thread may have held the old ones' locks at the fork.
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.argv = ["agoractl", *args]
        _own_exit_handlers()
        own_handlers = True
        from agoractl import logs

        logs.reset()  # the launcher's logging wrote to its terminal; the node writes JSON lines to its log
        runpy.run_module("agoractl", run_name="__main__", alter_sys=True)  # as `python -m agoractl` does
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - whatever happens, the child must not return into the launcher
        traceback.print_exc()
    finally:
        try:
            if own_handlers:
                atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
