""".ci/rerun_ids.py, which turns pytest's record of the failed tests into ids that .ci/run's rerun can collect:
without xdist's @group suffix, and a schemathesis subtest's id as its test's (one id pytest cannot find made
the rerun collect nothing, exit 5, and CI fail on a flaky first pass)."""

import importlib.util
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FUZZ = "tests/services/authorizer/test_openapi_fuzz.py::test_no_input_makes_a_server_error"
AVERAGING = "tests/runtime/test_averaging.py::test_a_peer_sending_nan_or_huge_parts_cannot_move_honest_replicas"


def load_rerun_ids():
    spec = importlib.util.spec_from_file_location("rerun_ids", ROOT / ".ci" / "rerun_ids.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_failed_ids_become_ids_that_pytest_collects(tmp_path):
    cache = tmp_path / "lastfailed"
    cache.write_text(json.dumps({
        f"{AVERAGING}[swarm0]@swarm": True,
        f"{FUZZ}[POST /v1/bans]": True,
        f"{FUZZ}[GET /v1/nodes]": True,
    }))
    rerun_ids = load_rerun_ids()
    failed = rerun_ids.recorded(str(cache))
    assert failed == [f"{AVERAGING}[swarm0]", f"{FUZZ}[GET /v1/nodes]", f"{FUZZ}[POST /v1/bans]"]
    ids = rerun_ids.rerun_ids(failed)
    assert ids == [f"{AVERAGING}[swarm0]", FUZZ]

    # pytest collects exactly these (the raw ids collect nothing, which is what the rerun used to get).
    def collect(nodeids):
        return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
                               "-p", "no:cacheprovider", *nodeids], cwd=ROOT, capture_output=True, text=True)
    out = collect(ids)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "2 tests collected" in out.stdout
    assert collect(failed).returncode != 0


def test_a_missing_or_unreadable_record_means_nothing_to_rerun(tmp_path):
    rerun_ids = load_rerun_ids()
    assert rerun_ids.recorded(str(tmp_path / "absent")) == []
    (tmp_path / "bad").write_text("{not json")
    assert rerun_ids.recorded(str(tmp_path / "bad")) == []
    assert rerun_ids.rerun_ids([]) == []
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "rerun_ids.py"), str(tmp_path / "absent")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == ""
