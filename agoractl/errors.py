"""Domain errors: what went wrong, in one line, with an optional hint saying what to do next.

Library code raises these and knows nothing of processes or exit codes; the command line maps each
kind to an exit code in one place (:data:`agoractl.cli.main.EXIT_CODES`: 2 for bad input, 1 for a
runtime failure, 3 for a stalled run, 128 + the signal for an interrupted one). A known error prints as one line (plus the hint); a traceback is shown only with
``AGORA_DEBUG=1``.
"""

from __future__ import annotations

from typing import Optional


class AgoraError(Exception):
    """Base of every error agoractl reports without a traceback."""

    def __init__(self, message: str, hint: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(AgoraError):
    """The input is wrong: a command-line argument, a manifest, or a file given as one."""


class RuntimeFailure(AgoraError):
    """The input was well formed but the work could not be carried out (storage, network, a node died)."""


class StalledRun(RuntimeFailure):
    """No optimizer step (or, in a trainer, no sample) completed for the stall timeout, and nothing left
    to restart."""


class Interrupted(AgoraError):
    """A run stopped by a signal (SIGINT, SIGTERM) after its processes were stopped."""

    def __init__(self, signum: int, message: str, hint: Optional[str] = None):
        super().__init__(message, hint)
        self.signum = signum
