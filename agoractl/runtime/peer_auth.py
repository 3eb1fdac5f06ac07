"""Every peer checks every other peer's credential when the manifest's admission is on (report §3.6.1.5).

- Stage RPCs: the caller puts its credential in the request's metadata (``cred``); the worker checks it
  against the caller's peer id, which libp2p's secure channel has already authenticated
  (:meth:`PeerAuth.gate_stage`).
- DHT records: :class:`CredentialValidator` (a hivemind record validator, living in the DHT's own process)
  prefixes every record this node stores with its credential and drops every record it is asked to store or
  is handed back that carries none, or a refused one; the run's worker and progress records must be bound to
  the peer id they are filed under. An unadmitted node can therefore neither announce itself to trainers nor
  declare itself for an averaging group (hivemind's matchmaking goes through the DHT; the averaging RPCs check
  credentials themselves as well: :mod:`agoractl.runtime.averaging_auth`). A record is bound to a
  credential, not signed per record: a copied credential lets its thief re-file the victim's own records until
  the credential expires, nothing more; the RPCs stay bound by libp2p.

Every refusal is counted by surface and reason.
"""

from __future__ import annotations

import collections
import threading
import time
from functools import partial
from typing import Callable, Optional

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from agoractl.auth import credential, keys
from agoractl.auth.credential import Credential, CredentialRefused
from agoractl.runtime.records import progress_key, trainers_key, workers_key

MAGIC = b"AGC1"


class PeerAuth:
    """This process's checks: the authority's public key, the ban list, and refusal counters."""

    def __init__(self, run: str, public_text: str) -> None:
        self.run, self.public_text, self.public = run, public_text, keys.parse_public(public_text)
        self.verifier = credential.Verifier(self.public)
        self.bans: frozenset[str] = frozenset()
        self.refusals: collections.Counter = collections.Counter()
        self.checked = 0
        self._lock = threading.Lock()

    def verify(self, token: Optional[str], surface: str, peer_id: Optional[str] = None, role=None,
               stage: Optional[str] = None) -> Credential:
        with self._lock:
            self.checked += 1
        try:
            return self.verifier.verify(token, run=self.run, peer_id=peer_id, role=role, stage=stage,
                                        banned=self.bans)
        except CredentialRefused as e:
            with self._lock:
                self.refusals[f"{surface}:{e.reason}"] += 1
            raise

    def gate_stage(self, stage: str) -> Callable[[dict, str], None]:
        """The check a worker runs before serving a stage request: a trainer's credential, bound to the caller."""

        def gate(meta: dict, caller: str) -> None:
            try:
                self.verify(meta.pop("cred", None), "stage_rpc", peer_id=caller, role="trainer")
            except CredentialRefused as e:
                raise PermissionError(f"credential refused: {e.reason}") from None

        return gate

    def gate_replica(self, stage: str, surface: str = "direct_mixing") -> Callable[[Optional[str], str], None]:
        """The check of a transport between a stage's replicas (:mod:`agoractl.runtime.direct_mixing` either way,
        :mod:`agoractl.runtime.progress_push`): a peer's credential must name a worker of `stage` bound to its peer
        id; refusals are counted under `surface`."""

        def gate(token: Optional[str], peer: str) -> None:
            try:
                self.verify(token, surface, peer_id=peer, role="worker", stage=stage)
            except CredentialRefused as e:
                raise PermissionError(f"credential refused: {e.reason}") from None

        return gate

    def stats(self) -> dict:
        with self._lock:
            return {"checked": self.checked, "refused": dict(self.refusals)}


class CredentialValidator(RecordValidatorBase):
    """hivemind record validator: records carry the storing node's credential; refused ones are dropped.
    Picklable (it is sent to the DHT's process); :func:`push` updates its credential and ban list there."""

    def __init__(self, run: str, public_text: str, stages: list[str]) -> None:
        self.run, self.public_text = run, public_text
        bound = [workers_key(run, s) for s in stages] + [progress_key(run, s) for s in stages]
        self._bound = {DHTID.generate(source=k).to_bytes() for k in bound}
        self._trainers = DHTID.generate(source=trainers_key(run)).to_bytes()
        self.token: Optional[str] = None
        self.bans: frozenset[str] = frozenset()
        self.refused: dict[str, int] = {}
        self.checked = 0
        self._verifier = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_verifier": None}

    def sign_value(self, record: DHTRecord) -> bytes:
        token = (self.token or "").encode()
        return MAGIC + len(token).to_bytes(2, "big") + token + record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        n = int.from_bytes(record.value[4:6], "big")
        return record.value[6 + n:]

    def validate(self, record: DHTRecord) -> bool:
        if self._verifier is None:
            self._verifier = credential.Verifier(keys.parse_public(self.public_text))
        value, token = record.value, None
        if value.startswith(MAGIC) and len(value) >= 6:
            n = int.from_bytes(value[4:6], "big")
            token = value[6:6 + n].decode(errors="replace") or None
        peer = None
        if record.key in self._bound:
            try:
                peer = MSGPackSerializer.loads(record.subkey)
            except Exception:
                peer = ""
            peer = peer if isinstance(peer, str) else ""
        self.checked += 1
        try:
            self._verifier.verify(token, run=self.run, peer_id=peer,
                                role="trainer" if record.key == self._trainers else None, banned=self.bans)
        except CredentialRefused as e:
            self.refused[e.reason] = self.refused.get(e.reason, 0) + 1
            return False
        return True

    @property
    def priority(self) -> int:
        return 10  # signs last, validates and strips first: other validators see the plain value


def _ours(node) -> Optional[CredentialValidator]:
    composite = node.protocol.record_validator
    return next((v for v in getattr(composite, "_validators", []) if isinstance(v, CredentialValidator)), None)


async def _push(_dht, node, token: Optional[str], bans: frozenset) -> None:
    v = _ours(node)
    if v is not None:
        v.token, v.bans = token, bans


async def _stats(_dht, node) -> dict:
    v = _ours(node)
    return {} if v is None else {"checked": v.checked, "refused": {f"dht:{k}": n for k, n in v.refused.items()}}


def push(dht, token: Optional[str], bans: frozenset) -> None:
    """Hand this node's current credential and the ban list to its DHT process's validator."""
    dht.run_coroutine(partial(_push, token=token, bans=bans))


def dht_stats(dht, timeout_s: float = 5.0) -> dict:
    """The validator's counts (records checked, refused by reason), from the DHT's process."""
    try:
        return dht.run_coroutine(_stats, return_future=True).result(timeout_s)
    except Exception:
        return {}


def merged_stats(auth: PeerAuth, dht) -> dict:
    own, d = auth.stats(), dht_stats(dht)
    return {"checked": own["checked"] + d.get("checked", 0), "refused": {**own["refused"], **d.get("refused", {})},
            "at": time.time()}
