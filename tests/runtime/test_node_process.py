"""How ``launch swarm`` starts its nodes (agoractl.runtime.node_process): forked from a process that imported the
node code, a node runs the same command line a subprocess would - in its own session, with the environment it
was given, stderr on its log, and its exit code - and the launch time that the run report counts start-up from
is exact. Each check runs in a fresh interpreter, as the launcher is (forking pytest's own process would copy
its threads and state). A forked node's exit runs its own exit handlers, not the launcher's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.conftest import ROOT

LAUNCHER = r"""
import atexit, json, os, sys, time
from pathlib import Path
from agoractl.runtime import node_process

node_process.warm(("agoractl.manifest.loader",))
log, args, extra = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
marker, me = log.with_suffix(".atexit"), os.getpid()
atexit.register(lambda: os.getpid() != me and marker.write_text("the child ran the launcher's exit handler"))
proc = node_process.start([sys.executable, "-m", "agoractl", *args], {**os.environ, **extra}, log, fork=True)
own_group = False
while proc.poll() is None and not own_group:  # setsid() comes first thing in the child
    try:
        own_group = os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        break
print(json.dumps({"code": proc.wait(60), "own_group": own_group, "launcher_handler_ran": marker.exists()}),
      flush=True)
"""


def _fork(tmp_path, args: list[str], env: dict) -> tuple[dict, str]:
    log = tmp_path / "node.log"
    out = subprocess.run([sys.executable, "-c", LAUNCHER, str(log), json.dumps(args), json.dumps(env)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "AGORA_DEBUG": "0"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), log.read_text()


def test_a_forked_node_runs_its_command_line_with_its_exit_code_and_log(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: agoractl/v1\nkind: Run\nmodel: {d_model: -1}\n")
    result, log = _fork(tmp_path, ["manifest", "validate", str(bad)], {})
    assert result["code"] == 2, (result, log)  # a manifest error: exit code 2, one line on the node's stderr
    assert log.startswith("error: ") and "d_model" in log and "Traceback" not in log, log


def test_a_forked_node_sees_its_own_environment_in_its_own_session(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: agoractl/v1\nkind: Run\nmodel: {d_model: -1}\n")
    result, log = _fork(tmp_path, ["manifest", "validate", str(bad)], {"AGORA_DEBUG": "1"})
    assert "Traceback" in log, log  # AGORA_DEBUG=1 came from the node's environment, not the launcher's (0)
    assert result["code"] != 0 and result["own_group"], result
    assert not result["launcher_handler_ran"], result  # the launcher's exit handlers stay the launcher's


def test_started_at_is_the_launch_time_not_a_second_early():
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "from agoractl.runtime.node_process import started_at; "
                                                "print(started_at())"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    after = time.time()
    started = float(out.stdout)
    # psutil's create_time can be up to 1 s early (the boot time in whole seconds); started_at is within a tick.
    assert before - 0.02 <= started <= after, (before, started, after)
