"""The CLI root (agoractl/cli/main.py): the lazily loaded command table and the exit-code mapping.

Hermetic: in-process, except one subprocess that checks what `agoractl --help` imports.
"""

import subprocess
import sys

import pytest

from agoractl.cli.main import COMMANDS, exit_code, load_command
from agoractl.errors import AgoraError, RuntimeFailure, UsageError
from agoractl.manifest.loader import ManifestError


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_table_line_is_the_commands_own_help(name):
    cmd = load_command(name)
    assert cmd.name == name
    assert (cmd.help or "").split("\n\n")[0].split("\n")[0].strip() == COMMANDS[name].help.split("\n")[0]


def test_root_help_imports_no_command_module():
    code = ("import sys\nfrom agoractl.cli.main import run\nsys.argv = ['agoractl', '--help']\n"
            "try:\n    run()\nexcept SystemExit:\n    pass\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('agoractl.') or m in ('torch', 'hivemind'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    modules = out.strip().splitlines()[-1].split()
    assert modules == ["agoractl.cli", "agoractl.cli.main", "agoractl.errors"], modules


def test_exit_codes_mapped_in_one_place():
    assert exit_code(UsageError("x")) == 2
    assert exit_code(ManifestError("f.yaml", [])) == 2
    assert exit_code(RuntimeFailure("x")) == 1
    assert exit_code(AgoraError("x")) == 1
