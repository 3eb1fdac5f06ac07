"""The manifest's workers section (agoractl.manifest.workers): ``self_feed`` only where whole-model replicas step on
their own counts, with no trainer started; trainers needed otherwise; the self-termination window rule."""

from __future__ import annotations

import pytest

from agoractl.manifest.loader import ManifestError, load_manifest
from tests.conftest import MANIFESTS


def problems(manifest: str, sets: list[str]) -> str:
    with pytest.raises(ManifestError) as e:
        load_manifest(MANIFESTS / manifest, sets)
    return str(e.value)


def test_the_dp_manifest_feeds_its_replicas_itself_and_trainers_can_instead():
    assert load_manifest(MANIFESTS / "fgdiloco-dp-cpu.yaml").workers.self_feed
    fed = load_manifest(MANIFESTS / "fgdiloco-dp-cpu.yaml", ["workers.self_feed=false", "local.trainers=1"])
    assert not fed.workers.self_feed and fed.local.trainers == 1


@pytest.mark.parametrize("manifest,sets,field", [
    ("local-cpu.yaml", ["workers.self_feed=true", "local.trainers=0"], "workers.self_feed"),  # a pipeline
    ("fgdiloco-dp-cpu.yaml", ["data_parallel.fgdiloco.replicas=null"], "workers.self_feed"),  # collective counts
    ("fgdiloco-dp-cpu.yaml", ["data_parallel.method=sparta"], "workers.self_feed"),
    ("fgdiloco-dp-cpu.yaml", ["local.trainers=1"], "local.trainers"),  # a trainer with nothing to feed
    ("fgdiloco-dp-cpu.yaml", ["workers.self_feed=false"], "local.trainers"),  # nobody would feed the replicas
    ("local-cpu.yaml", ["workers.self_termination.allreduce_failures=4"], "allreduce_failures"),
])
def test_incoherent_workers_settings_name_the_field(manifest, sets, field):
    assert field in problems(manifest, sets)
