"""The run report: one JSON document per run, written by ``launch central`` and ``launch swarm`` alike.

Keys every report has (so a central reference and a swarm compare key by key):

- ``mode``: ``central`` or ``swarm``; ``name``: the manifest's metadata.name
- ``steps``: optimizer steps completed; ``tokens``: input tokens trained on (steps x batch x seq_len)
- ``elapsed_s``: wall-clock seconds of training; ``tokens_per_s`` = tokens / elapsed_s
- ``loss``: [step, loss] pairs, step 0-based, loss the mean cross-entropy of that step's global batch
- ``final_loss``: the mean of the last ``FINAL_WINDOW`` entries of ``loss`` (fewer if the run is
  shorter; null when there are none): one step's loss is too noisy to compare runs by

Anything else a producer knows (device, batch, gradient norms, averaging health) goes beside them.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from agoractl import storage

FINAL_WINDOW = 5
"""Steps averaged into ``final_loss``."""


def final_loss(loss: Sequence[Sequence[float]], window: int = FINAL_WINDOW) -> Optional[float]:
    """Mean loss of the last `window` [step, loss] pairs; None when there are none."""
    tail = [float(v) for _, v in loss[-window:]]
    return sum(tail) / len(tail) if tail else None


def run_report(*, mode: str, name: str, steps: int, tokens: int, elapsed_s: float,
               loss: Sequence[Sequence[float]], **extra: Any) -> dict[str, Any]:
    """The report dict with the shared keys first, then `extra`."""
    return {
        "mode": mode,
        "name": name,
        "steps": steps,
        "tokens": tokens,
        "elapsed_s": round(elapsed_s, 3),
        "tokens_per_s": tokens / elapsed_s if elapsed_s > 0 else 0.0,
        "loss": [[int(s), float(v)] for s, v in loss],
        "final_loss": final_loss(loss),
        **extra,
    }


def write_report(run_dir: str, filename: str, report: dict[str, Any]) -> str:
    """Write `report` as ``<run_dir>/<filename>`` atomically; returns its path or URL."""
    url = storage.join(run_dir, filename)
    storage.write_bytes_atomic(url, (json.dumps(report, indent=2) + "\n").encode())
    return url
