"""The ids of the tests that failed in the last pytest run, in a form pytest can collect again (for .ci/run).

Reads pytest's cache (`.pytest_cache/v/cache/lastfailed`, a JSON map, or the file given as the first argument)
and prints one collectable node id per line:

- xdist's loadgroup appends "@<group>" to the ids it records ("...::test_x[swarm0]@swarm"); it is dropped.
- Some recorded ids name no collectable item: schemathesis reports each operation as a subtest
  ("...::test_no_input_makes_a_server_error[POST /v1/bans]") of one pytest item. One id that pytest cannot find
  makes it collect nothing at all, so such an id becomes its item's ("...::test_no_input_makes_a_server_error").

Whether an id is collectable is asked of pytest itself (`--collect-only` over the failed tests' files).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys


def recorded(path: str) -> list[str]:
    """The failed ids in the cache file, without xdist's @group suffix; none when the file is missing or bad."""
    try:
        with open(path, encoding="utf-8") as f:
            failed = json.load(f)
    except (OSError, ValueError):
        return []
    return sorted({re.sub(r"@[^:\[\]/]+$", "", n) for n in failed})


def collectable(files: list[str]) -> set[str]:
    """Every node id pytest collects from these files (no xdist, no cache writes)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", *files],
        capture_output=True, text=True, check=False,
    ).stdout
    return {line.strip() for line in out.splitlines() if "::" in line and not line.startswith(" ")}


def rerun_ids(failed: list[str]) -> list[str]:
    """Each failed id, or its item's id where the id itself names no collectable item; in order, no repeats."""
    if not failed:
        return []
    known = collectable(sorted({n.split("::", 1)[0] for n in failed}))
    ids: list[str] = []
    for nodeid in failed:
        base = re.sub(r"\[.*\]$", "", nodeid)
        chosen = base if nodeid not in known and base in known else nodeid
        if chosen not in ids:
            ids.append(chosen)
    return ids


if __name__ == "__main__":
    cache = sys.argv[1] if len(sys.argv) > 1 else ".pytest_cache/v/cache/lastfailed"
    for nodeid in rerun_ids(recorded(cache)):
        print(nodeid)
