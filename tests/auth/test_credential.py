"""Credentials (in-memory, no network): every refusal has its own reason, and a valid one round-trips; a
:class:`~agoractl.auth.credential.Verifier` (signatures remembered per token) refuses exactly what ``verify`` does."""

from __future__ import annotations

import pytest

from agoractl.auth import credential, keys
from agoractl.auth.credential import CredentialRefused

KEY = keys.generate()
PUB = KEY.public_key()


def token(**kw) -> str:
    args = dict(run="run", node_id="w1", account="alice", role="worker", stage="body-1", peer_id="12D3KooWA",
                ttl_s=60, serial=7)
    return credential.issue(KEY, **{**args, **kw})


VERIFIER = credential.Verifier(PUB)
"""One for the whole module: tokens it has seen before are checked from its memory of their signature."""


@pytest.fixture(params=["verify", "Verifier"])
def reason(request):
    def reason(tok, **kw) -> str:
        args = dict(run="run", peer_id="12D3KooWA", role="worker", stage="body-1")
        with pytest.raises(CredentialRefused) as e:
            if request.param == "verify":
                credential.verify(tok, PUB, **{**args, **kw})
            else:
                VERIFIER.verify(tok, **{**args, **kw})
        return e.value.reason
    return reason


def test_valid_credential_round_trips():
    cred = credential.verify(token(), PUB, run="run", peer_id="12D3KooWA", role=("worker", "trainer"), stage="body-1")
    assert (cred.node_id, cred.account, cred.serial, cred.authority) == ("w1", "alice", 7, keys.key_id(KEY))
    assert cred.expires_at - cred.issued_at == 60


def test_each_failure_has_its_reason(reason):
    good = token()
    assert reason(None) == "missing"
    assert reason("") == "missing"
    assert reason("nodot") == "malformed"
    assert reason("!!!.???") == "malformed"
    assert reason("e30.AAAA") == "malformed"  # {} : fields missing
    assert reason(credential.tampered(good, stage="head")) == "forged"
    assert reason(credential.tampered(good, expires_at=9e12)) == "forged"
    assert reason(credential.issue(keys.generate(), run="run", node_id="w1", account="a", role="worker",
                                   stage="body-1", peer_id="12D3KooWA", ttl_s=60, serial=1)) == "other_authority"
    assert reason(good, peer_id="12D3KooWB") == "wrong_peer"
    assert reason(token(ttl_s=-1)) == "expired"
    assert reason(token(run="other")) == "wrong_run"
    assert reason(good, role="trainer") == "wrong_role"
    assert reason(good, stage="tail") == "wrong_stage"
    assert reason(good, banned=["w1"]) == "banned"
    assert reason(good, banned=["alice"]) == "banned"
    assert set(credential.REFUSALS) == {"missing", "malformed", "other_authority", "forged", "wrong_peer", "expired",
                                        "wrong_run", "wrong_role", "wrong_stage", "banned"}


def test_a_remembered_signature_still_expires_and_is_banned_and_a_forged_one_is_never_remembered():
    verifier = credential.Verifier(PUB)
    good = token(ttl_s=60)
    cred = verifier.verify(good, run="run", peer_id="12D3KooWA", role="worker", stage="body-1")
    assert verifier._signed == {good: cred}
    for kw, why in ((dict(now=cred.expires_at), "expired"), (dict(banned=frozenset({"alice"})), "banned"),
                    (dict(peer_id="12D3KooWB"), "wrong_peer"), (dict(stage="tail"), "wrong_stage")):
        with pytest.raises(CredentialRefused) as e:
            verifier.verify(good, **{**dict(run="run", peer_id="12D3KooWA", role="worker", stage="body-1"), **kw})
        assert e.value.reason == why
    forged = credential.tampered(good, stage="tail")
    for _ in range(2):
        with pytest.raises(CredentialRefused, match="forged"):
            verifier.verify(forged, run="run", peer_id="12D3KooWA", role="worker", stage="tail")
    assert forged not in verifier._signed
    other = credential.issue(keys.generate(), run="run", node_id="w1", account="a", role="worker", stage="body-1",
                             peer_id="12D3KooWA", ttl_s=60, serial=1)
    with pytest.raises(CredentialRefused, match="other_authority"):
        verifier.verify(other, run="run", peer_id="12D3KooWA")
    assert list(verifier._signed) == [good]
    verifier.REMEMBERED = 1  # full: forgotten, then the new one remembered
    second = token(serial=8)
    verifier.verify(second, run="run", peer_id="12D3KooWA")
    assert list(verifier._signed) == [second]


def test_admin_token_has_no_peer_and_role_admin():
    cred = credential.verify(credential.admin_token(KEY, "run"), PUB, run="run", role="admin")
    assert cred.peer_id == "" and cred.operator


def test_keys_write_and_load(tmp_path):
    path, pub, key = keys.write_pair(tmp_path / "authority.key")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert keys.public_text(keys.load_private(path)) == pub.read_text().strip() == keys.public_text(key)
    assert keys.key_id(keys.parse_public(pub.read_text())) == keys.key_id(key)
    from agoractl.errors import RuntimeFailure, UsageError

    with pytest.raises(UsageError, match="already exists"):
        keys.write_pair(path)
    with pytest.raises(UsageError, match="not an Ed25519 public key"):
        keys.parse_public("abc")
    (tmp_path / "junk").write_text("not a key")
    with pytest.raises(RuntimeFailure, match="not a PEM private key"):
        keys.load_private(tmp_path / "junk")
    with pytest.raises(UsageError, match="no such file"):
        keys.load_private(tmp_path / "missing")
