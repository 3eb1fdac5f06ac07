"""Tests of manifest loading (agoractl.manifest.loader): every error at once, dotted paths, file:line,
--set overrides. In-memory and tmp files only."""

import pytest

from agoractl.cli.main import exit_code
from agoractl.errors import UsageError
from agoractl.manifest.loader import ManifestError, apply_overrides, load_manifest, split_path

THREE_MISTAKES = """\
apiVersion: agoractl/v1
kind: Run
model:
  n_layers: 4
stages:
  - {role: head, layers: 2}
  - {role: tail, layers: 1}
trainig:
  max_steps: 10
data_parallel:
  sparta:
    fraction: 1.5
"""


def write(tmp_path, text, name="m.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_three_mistakes_reported_together_with_path_and_line(tmp_path):
    p = write(tmp_path, THREE_MISTAKES)
    with pytest.raises(ManifestError) as e:
        load_manifest(p)
    got = {(x.path, x.location) for x in e.value.problems}
    assert ("trainig", f"{p}:8") in got
    assert ("data_parallel.sparta.fraction", f"{p}:12") in got
    assert ("stages", f"{p}:5") in got
    msgs = {x.path: x.message for x in e.value.problems}
    assert "did you mean 'training'" in msgs["trainig"]
    assert "sum to 3" in msgs["stages"] and "n_layers is 4" in msgs["stages"]
    assert exit_code(e.value) == 2  # the CLI maps a manifest error to exit 2


def test_nested_typo_suggests_dotted_key(tmp_path):
    p = write(tmp_path, "data_parallel:\n  sparta:\n    fractoin: 0.1\n")
    with pytest.raises(ManifestError) as e:
        load_manifest(p)
    (prob,) = e.value.problems
    assert prob.path == "data_parallel.sparta.fractoin"
    assert "data_parallel.sparta.fraction" in prob.message
    assert prob.location.endswith(":3")


def test_cross_field_rules(tmp_path):
    p = write(tmp_path, """\
model: {d_model: 60, n_heads: 8, n_kv_heads: 3, n_layers: 2, ssn: {rank: 64}}
stages: [{role: body, layers: 1}, {role: head, layers: 1}]
workers: {self_termination: {allreduce_failures: 4, window_rounds: 3}}
""")
    with pytest.raises(ManifestError) as e:
        load_manifest(p)
    paths = {x.path for x in e.value.problems}
    assert {"model.n_heads", "model.ssn.rank", "stages[0].role", "stages[1].role",
            "workers.self_termination.allreduce_failures"} <= paths


def test_wrong_field_does_not_cause_spurious_cross_errors(tmp_path):
    p = write(tmp_path, "model: {n_layers: -1}\n")
    with pytest.raises(ManifestError) as e:
        load_manifest(p)
    assert [x.path for x in e.value.problems] == ["model.n_layers"]


def test_set_overrides_apply_before_validation(tmp_path):
    p = write(tmp_path, "training: {max_steps: 10}\nstages: [{role: head, layers: 2}, {role: tail, layers: 1}]\n")
    run = load_manifest(p, ["training.max_steps=7", "data_parallel.sparta.fraction=0.25",
                            "stages[1].layers=2", "model.n_layers=4", "metadata.description=a b"])
    assert run.training.max_steps == 7
    assert run.data_parallel.sparta.fraction == 0.25
    assert run.n_segments() == 4
    assert run.stages[1].layers == 2
    with pytest.raises(UsageError, match="out of range"):
        load_manifest(p, ["stages[5].layers=1"])
    with pytest.raises(ManifestError) as e:
        load_manifest(p, ["data_parallel.sparta.fraction=2", "model.n_layers=3"])
    assert e.value.problems[0].location == "--set"


@pytest.mark.parametrize("bad", ["noequals", "a..b=1", "=3"])
def test_bad_set_syntax(bad):
    with pytest.raises(UsageError):
        apply_overrides({}, [bad])


def test_split_path():
    assert split_path("stages[2].layers") == ["stages", 2, "layers"]
    assert split_path("stages.2.layers") == ["stages", 2, "layers"]


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(UsageError, match="no such manifest"):
        load_manifest(tmp_path / "nope.yaml")
    p = write(tmp_path, "model: {d_model: [1, 2\n")
    with pytest.raises(ManifestError) as e:
        load_manifest(p)
    assert e.value.problems[0].location.startswith(str(p))
    p = write(tmp_path, "- a\n- b\n", "list.yaml")
    with pytest.raises(ManifestError, match="mapping"):
        load_manifest(p)


def test_header_only_manifest_is_the_default_run(tmp_path):
    # An empty file used to be the default run; issue 14 made it an error naming apiVersion and kind.
    run = load_manifest(write(tmp_path, "apiVersion: agoractl/v1\nkind: Run\n"))
    assert run.stage_names() == ["head", "body-1", "tail"]


@pytest.mark.parametrize("text", ["", "# a comment and nothing else\n", "{}\n"])
def test_empty_manifest_names_apiversion_and_kind(tmp_path, text):
    p = write(tmp_path, text)
    with pytest.raises(UsageError) as e:
        load_manifest(p)
    assert not isinstance(e.value, ManifestError)
    assert e.value.message == f"{p}: the manifest is empty: apiVersion and kind are missing"
    assert "apiVersion: agoractl/v1" in e.value.hint


@pytest.mark.parametrize("blob", [b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", b"apiVersion: agoractl/v1\n\x00\x01\x02"])
def test_binary_file_is_not_utf8_yaml(tmp_path, blob):
    p = tmp_path / "weights.bin"
    p.write_bytes(blob)
    with pytest.raises(UsageError) as e:
        load_manifest(p)
    assert e.value.message.startswith(f"{p}: not UTF-8 YAML (")
    assert "\n" not in e.value.message
