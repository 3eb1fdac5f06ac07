"""The layering contract (pyproject's [tool.importlinter], docs/architecture.md): imports point down
only, siblings on a layer are independent, algorithms never touch the network, no package cycles;
and every module stays small enough to read in one sitting."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = pathlib.Path(sys.executable).with_name("lint-imports")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "agoractl").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_runtime_holds_only_networked_modules():
    """Every runtime module reaches hivemind, directly, through the DHT records it is handed, or
    through another runtime module; or opens sockets of its own (the emulated hosts' delay line and link
    probe)."""
    runtime = ROOT / "agoractl" / "runtime"
    texts = {p.stem: p.read_text() for p in runtime.glob("*.py") if p.stem != "__init__"}
    networked = {m for m, t in texts.items() if "hivemind" in t or "records." in t
                 or "import socket" in t or "asyncio.start_server" in t}
    grew = True
    while grew:
        grew = False
        for m, t in texts.items():
            if m not in networked and any(f"agoractl.runtime.{n}" in t or f"import {n}" in t for n in networked):
                networked.add(m)
                grew = True
    assert networked == set(texts), sorted(set(texts) - networked)
