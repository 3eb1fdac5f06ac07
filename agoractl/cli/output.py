"""One output sink: human tables on stdout, or machine-readable JSON with ``--json``.

Data goes to stdout, diagnostics (logs, progress, errors) to stderr. In JSON mode nothing but the
JSON document is written to stdout: no colour, no progress bars.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Optional

from rich.console import Console

stdout = Console(soft_wrap=True, highlight=False, width=None if sys.stdout.isatty() else 160)
stderr = Console(stderr=True, soft_wrap=True, highlight=False)


def emit(data: Any, as_json: bool, render: Optional[Callable[[Any], None]] = None) -> None:
    """Print `data`: JSON when `as_json` (or no renderer), else through `render`."""
    if as_json or render is None:
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
        sys.stdout.flush()
    else:
        render(data)


def note(message: str) -> None:
    """A diagnostic line on stderr (never on stdout, so --json output stays clean)."""
    stderr.print(message)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def human_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def human_rate(mbps: float) -> str:
    """Mbit/s with three significant digits below 100 (a tiny run needs 0.402, not 0), whole above."""
    if mbps == 0 or abs(mbps) >= 100:
        return f"{mbps:.0f}"
    if abs(mbps) < 0.001:
        return f"{mbps:.2e}"
    return f"{mbps:.3g}"
