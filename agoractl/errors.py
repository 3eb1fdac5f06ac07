"""Known errors and their exit codes: 2 for usage and manifest errors, 1 for runtime failures.

A known error prints as one line (plus an optional hint saying what to do next); tracebacks are
shown only with ``AGORA_DEBUG=1`` (see :mod:`agoractl.cli.main`).
"""

from __future__ import annotations

from typing import Optional


class AgoraError(Exception):
    """Base of every error agoractl reports without a traceback."""

    exit_code = 1

    def __init__(self, message: str, hint: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(AgoraError):
    """Bad command-line arguments or an invalid manifest (exit code 2)."""

    exit_code = 2


class RuntimeFailure(AgoraError):
    """The command was well formed but could not be carried out (exit code 1)."""

    exit_code = 1
