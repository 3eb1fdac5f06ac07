"""The pure parts of churn (agoractl.runtime.churn): the schedule, the choice of a worker, the roles of a
swarm's workers, and the request/answer files between ``ops churn`` and the launcher. In-memory and tmp files."""

import json
import os
import random
import threading

from agoractl.runtime import churn


def test_schedule_is_bounded_in_time_and_count():
    assert churn.schedule(20, 60, None) == [20, 40, 60]
    assert churn.schedule(20, 60, 2) == [20, 40]
    assert churn.schedule(60, 30, None) == []


def test_pick_never_takes_the_last_live_worker_of_a_stage():
    workers = [{"name": "worker-head-0", "stage": "head"}, {"name": "worker-tail-0", "stage": "tail"},
               {"name": "worker-tail-1", "stage": "tail"}]
    picks = {churn.pick(workers, random.Random(s))["name"] for s in range(20)}
    assert picks == {"worker-tail-0", "worker-tail-1"}
    assert churn.pick(workers[:2], random.Random(0)) is None


def test_pick_spares_a_stage_whose_newcomer_has_not_joined_yet():
    """Two live workers of which one still joins (no serving record yet): killing either would leave the
    stage without a joined worker, or a replacement that never joined; the other stage is picked."""
    workers = [{"name": "worker-head-0", "stage": "head", "serving": True},
               {"name": "worker-head-1.rc1", "stage": "head", "serving": False},
               {"name": "worker-tail-0", "stage": "tail", "serving": True},
               {"name": "worker-tail-1", "stage": "tail", "serving": True}]
    assert {churn.pick(workers, random.Random(s))["name"] for s in range(20)} == {"worker-tail-0", "worker-tail-1"}
    assert churn.pick(workers[:3], random.Random(0)) is None


def test_status_marks_the_workers_that_serve():
    """The launcher's status.json says which worker processes have a serving DHT record (by pid)."""
    from types import SimpleNamespace as NS

    def node(name, pid, kind="worker"):
        return NS(name=name, kind=kind, stage="head", proc=NS(pid=pid), poll=lambda: None)

    snap = NS(workers={"head": {"a": NS(pid=11, phase="active"), "b": NS(pid=12, phase="weight_sync")}})
    out = churn.node_status([node("w0", 11), node("w1", 12), node("t0", 13, "trainer")], snap)
    assert [n.get("serving") for n in out] == [True, False, None]


def test_last_workers_of_a_stage_are_contributors():
    assert [churn.worker_role(f"worker-body-1-{i}", 3, 1) for i in range(3)] == ["operator", "operator", "contributor"]
    assert churn.worker_role("worker-body-1-2.r1", 3, 1) == "contributor"  # a restart keeps its role
    assert churn.worker_role("worker-head-0", 2, 0) == "operator"


def test_a_request_is_answered_through_files(tmp_path):
    folder = tmp_path / "swarm" / churn.REQUESTS

    def launcher():  # what serve_requests does, minus the processes
        while not list(folder.glob("*.json")):
            threading.Event().wait(0.05)
        req = next(folder.glob("*.json"))
        (folder / f"{req.stem}.done.json").write_text(json.dumps({"killed": json.loads(req.read_text())["node"]}))

    t = threading.Thread(target=launcher)
    t.start()
    assert churn.request(tmp_path, "worker-head-1", timeout_s=30) == {"killed": "worker-head-1"}
    t.join()


def test_a_request_ends_when_the_launcher_is_gone(tmp_path):
    """`ops churn` does not wait out --answer-timeout-s (nor its schedule) for a launcher that has exited: the
    status names the launcher's pid, and a pid that is gone ends the wait at once."""
    import subprocess
    import sys
    import time

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    status = tmp_path / "status.json"
    status.write_text(json.dumps({"launcher_pid": gone.pid}))
    assert not churn.launcher_alive(churn.read_status(status))
    assert churn.launcher_alive({"launcher_pid": os.getpid()}) and churn.launcher_alive({})
    t0 = time.monotonic()
    assert churn.request(tmp_path, "worker-head-0", 30, status) is None
    assert time.monotonic() - t0 < 5
