"""The options every command shares (agoractl/cli/common.py): the Enums of fixed-value options agree with
the library's own names, --stage and --device are checked in one place each, and a wrong value gets
the same one-line error and hint everywhere. In-process, plus a few real `agoractl` invocations in one
subprocess (``cli.batch``)."""

import pytest

from agoractl.cli.common import (ArParams, FaultPoint, GlobalMixing, Role, Scenario, check_device, check_stage,
                                 stage_index)
from agoractl.errors import UsageError
from agoractl.manifest.loader import load_manifest
from agoractl.manifest.plan import make_plan
from tests.conftest import MANIFESTS

MANIFEST = MANIFESTS / "local-cpu.yaml"


def test_enums_are_the_librarys_names():
    from agoractl.runtime import faults, records
    from agoractl.sim import comm_model, scenarios

    assert tuple(Role) == records.ROLES
    assert tuple(FaultPoint) == faults.FAULT_POINTS
    assert tuple(GlobalMixing) == comm_model.GLOBAL_MIXING
    assert all(callable(getattr(scenarios, s.value.replace("-", "_"))) for s in Scenario)
    run = load_manifest(MANIFEST)
    for p in ArParams:  # both are accepted by the plan
        make_plan(run, ar_params=p.value)


def test_stage_and_device_checks():
    run = load_manifest(MANIFEST)
    assert check_stage(run, "body-1") == "body-1" and stage_index(run, "tail") == 2
    assert check_stage(run, "auto", allow_auto=True) == "auto"
    with pytest.raises(UsageError, match=r"^--stage auto: no such stage; stages are head, body-1, tail$"):
        check_stage(run, "auto")
    with pytest.raises(UsageError, match=r"\(or auto\)$"):
        check_stage(run, "middle", allow_auto=True)
    assert [check_device(d) for d in ("cpu", "cuda", "cuda:1")] == ["cpu", "cuda", "cuda:1"]
    assert check_device("auto", allow_auto=True) == "auto"
    for bad in ("gpu", "auto", "cuda:x"):
        with pytest.raises(UsageError, match=f"^--device {bad}: not a device name$"):
            check_device(bad)


def test_help_lists_the_values_and_a_wrong_one_is_one_line(cli):
    worker, simulate, role, stage = cli.batch(["launch", "worker", "--help"], ["simulate", "--help"],
                                              ["launch", "worker", MANIFEST, "--stage", "head", "--role", "boss"],
                                              ["launch", "worker", MANIFEST, "--stage", "middle"],
                                              env={"COLUMNS": "200"})
    assert [p.returncode for p in (worker, simulate, role, stage)] == [0, 0, 2, 2], [p.stderr for p in
                                                                                     (worker, simulate, role, stage)]
    out = worker.stdout
    assert "<operator|contributor>" in out
    out = simulate.stdout
    assert "<fgdiloco|sparta-backward|sparta-participation>" in out and "<auto|shards|synthetic>" in out
    err = role.stderr
    assert err.splitlines() == [
        "error: Invalid value for '--role': 'boss' is not one of 'operator', 'contributor'.",
        "hint: `agoractl launch worker --help` lists the arguments, options and their values",
    ]
    err = stage.stderr
    assert err.splitlines()[0] == "error: --stage middle: no such stage; stages are head, body-1, tail (or auto)"
