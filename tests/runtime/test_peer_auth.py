"""The run's DHT record validator (agoractl.runtime.peer_auth.CredentialValidator) between real DHT processes.

A seed and an admitted node hold the validator (and the ban list); a rogue node runs it too but signs its
records with a credential that is missing, tampered, signed by another authority, the admitted node's (another
peer's), expired, or a banned node's, ATTEMPTS records each. None of the rogue's records can be read from the
seed or the admitted node, each refusal is counted with its reason, and the admitted node's own records are
stored and read as usual. About half a minute on a loaded 2-core machine.
"""

from __future__ import annotations

import time

import hivemind
import pytest
from hivemind.utils import get_dht_time

from agoractl.auth import credential, keys
from agoractl.runtime import peer_auth
from agoractl.runtime.peer_auth import CredentialValidator
from agoractl.runtime.records import workers_key

RUN, STAGE = "test", "body-1"
ATTEMPTS = 3
OPTIONS = dict(start=True, startup_timeout=120, await_ready=True, cache_refresh_before_expiry=0, cache_nearest=0)


@pytest.fixture
def nodes(tmp_path):
    """(key, seed, admitted, rogue): three DHT processes with the run's validator, the ban list ["evil"]."""
    key = keys.generate()
    started = []
    try:
        for _ in range(3):
            peers = [str(a) for a in started[0].get_visible_maddrs()] if started else None
            dht = hivemind.DHT(initial_peers=peers, **OPTIONS)
            started.append(dht)
            dht.add_validators([CredentialValidator(RUN, keys.public_text(key), [STAGE])])
            peer_auth.push(dht, None, frozenset({"evil"}))
        yield key, *started
    finally:
        for dht in started:
            dht.shutdown()


def test_dht_drops_every_forged_record_and_keeps_honest_ones(nodes):
    key, seed, admitted, rogue = nodes
    ours, theirs = admitted.peer_id.to_base58(), rogue.peer_id.to_base58()

    def token(peer, k=key, ttl=300.0, node_id="node"):
        return credential.issue(k, run=RUN, node_id=node_id, account="x", role="worker", stage=STAGE, peer_id=peer,
                                ttl_s=ttl, serial=1)

    honest = token(ours, node_id="honest")
    peer_auth.push(admitted, honest, frozenset({"evil"}))
    workers = workers_key(RUN, STAGE)
    expiry = get_dht_time() + 300
    assert admitted.store(workers, subkey=ours, value={"phase": "visible"}, expiration_time=expiry)
    assert admitted.store("test.free.honest", value=1, expiration_time=expiry)

    bad = {"missing": None,
           "forged": credential.tampered(token(theirs), expires_at=9e12),
           "other_authority": token(theirs, k=keys.generate()),
           "wrong_peer": honest,  # the admitted node's own, copied: bound to its peer id, not the rogue's
           "expired": token(theirs, ttl=-1),
           "banned": token(theirs, node_id="evil")}
    for reason, t in bad.items():
        peer_auth.push(rogue, t, frozenset())
        for i in range(ATTEMPTS):
            rogue.store(workers, subkey=theirs, value={"phase": "visible", "attempt": i}, expiration_time=expiry)
            if reason != "wrong_peer":  # a copied credential passes on records not bound to a peer (docs/admission.md)
                rogue.store(f"test.free.{reason}.{i}", value=i, expiration_time=expiry)

    for reader in (seed, admitted):
        found = reader.get(workers, latest=True)
        assert found is not None and set(found.value) == {ours}, found
        assert reader.get("test.free.honest", latest=True).value == 1
        for reason in bad:
            for i in range(ATTEMPTS if reason != "wrong_peer" else 0):
                assert reader.get(f"test.free.{reason}.{i}", latest=True) is None, (reason, i)
    refused = {}
    for dht in (seed, admitted):
        for k, n in peer_auth.dht_stats(dht).get("refused", {}).items():
            refused[k] = refused.get(k, 0) + n
    for reason in bad:
        assert refused.get(f"dht:{reason}", 0) >= ATTEMPTS, refused

    # The honest node goes on storing after the attack.
    time.sleep(0.1)
    assert admitted.store(workers, subkey=ours, value={"phase": "visible", "again": True}, expiration_time=expiry + 1)
    assert seed.get(workers, latest=True).value[ours].value == {"phase": "visible", "again": True}
