"""Tests of the scripts in benchmarks/ (not a package): :func:`load_benchmark` imports one by name."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.conftest import ROOT


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (its directory on sys.path, for the helpers it imports)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
