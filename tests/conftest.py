"""Shared pytest fixtures: the repository root, shipped manifests, and running the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"


@pytest.fixture
def cli(tmp_path):
    """Run `python -m agoractl ARGS` in tmp_path as a real subprocess; returns CompletedProcess."""

    def run(*args, cwd=None, env=None, timeout=300, check=None):
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env.pop("AGORA_DEBUG", None) if not (env and "AGORA_DEBUG" in env) else None
        proc = subprocess.run([sys.executable, "-m", "agoractl", *map(str, args)], cwd=cwd or tmp_path,
                              env=full_env, capture_output=True, text=True, timeout=timeout)
        if check is not None:
            assert proc.returncode == check, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        return proc

    return run
