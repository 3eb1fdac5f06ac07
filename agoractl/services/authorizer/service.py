"""The Authorizer's decisions, independent of HTTP: join (checks, queue, rate limit, capacity, placement,
credential), renewal, leaving, bans, accounts, the live policy, and the report.

Every refusal or wait is stored in the ``decisions`` table with a reason code from :data:`REASONS`.
"""

from __future__ import annotations

import secrets
from typing import Optional

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from agoractl.auth import credential, keys
from agoractl.auth.placement import StageSlot, place
from agoractl.manifest.admission import Admission, admission_errors
from agoractl.manifest.schema import Run
from agoractl.services.authorizer import checks
from agoractl.services.authorizer.live import policy_json
from agoractl.services.authorizer.models import Account, Ban, Decision, Node, Serial

REASONS = ("capacity", "malformed", "outdated_client", "unreachable", "invalid_token", "below_requirements",
           "banned", "rate_limited")
"""Why a node was refused or made to wait (report §5.3.3)."""


def _deep_merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for k, v in changes.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class PolicyError(ValueError):
    """A policy change that does not validate; the message names the field."""


class Authorizer:
    def __init__(self, run: Run, engine: Engine, live, key: Ed25519PrivateKey) -> None:
        self.run, self.engine, self.live, self.key = run, engine, live, key
        self.names = run.stage_names()
        if live.get_policy() is None:
            live.set_policy(policy_json(run.admission.model_dump()))
        self._restore_queue()

    # -- policy ---------------------------------------------------------------------------------------
    def policy(self) -> Admission:
        return Admission.model_validate_json(self.live.get_policy())

    def set_policy(self, changes: dict) -> Admission:
        merged = _deep_merge(self.policy().model_dump(), changes)
        try:
            new = Admission.model_validate(merged)
        except ValidationError as e:
            err = e.errors()[0]
            raise PolicyError(f"admission.{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        problems = admission_errors(new, self.names)
        if problems:
            raise PolicyError(f"{problems[0][0]}: {problems[0][1]}")
        self.live.set_policy(policy_json(new.model_dump()))
        return new

    # -- join -----------------------------------------------------------------------------------------
    def join(self, req: dict) -> tuple[int, dict]:
        """(HTTP status, body) for a join request or a poll of one; admits when the node says it is ready."""
        policy, nid = self.policy(), req["node_id"]
        with Session(self.engine) as s:
            acct = s.get(Account, req["account"])
            operator = bool(acct and acct.operator
                            and checks.account_token_ok(acct.token_hash, req.get("account_token")))
            refusal = self._screen(s, policy, req, acct, operator)
            if refusal:
                return self._refuse(s, nid, *refusal)
            node = s.get(Node, nid)
            if node is not None and node.status == "admitted" and node.peer_id == req["peer_id"]:
                token = self._credential(s, node, policy)
                s.commit()
                return 200, self._admitted_body(node, token)
            now = self.live.now()
            if node is None or node.status != "queued":
                node = s.merge(Node(node_id=nid, account=req["account"], operator=operator, role=req["role"],
                                    peer_id=req["peer_id"], stage=None, status="queued", hardware=req["hardware"],
                                    multiaddrs=req.get("multiaddrs", []), requested_at=now, step=0))
                s.commit()
            self.live.enqueue(nid, node.requested_at)
            if not req.get("ready"):
                return 200, self._queued_body(nid, "", 0.0)
        return self._admit(nid, policy)

    def _screen(self, s: Session, policy: Admission, req: dict, acct: Optional[Account], operator: bool):
        if s.get(Ban, req["node_id"]) or s.get(Ban, req["account"]):
            return "banned", "node or account is banned"
        if policy.checks.accountability and not (acct and checks.account_token_ok(acct.token_hash,
                                                                                  req.get("account_token"))):
            return "invalid_token", f"account {req['account']!r}: unknown or wrong token"
        if req["role"] == "worker" and req.get("stage") and req["stage"] not in self.names:
            return "malformed", f"no stage {req['stage']!r}"
        if policy.checks.integrity and (r := checks.integrity(policy, req.get("client", {}))):
            return r
        if (policy.checks.capability and req["role"] != "monitor"  # a monitor reads records: no hardware needs
                and (r := checks.capability(policy, req["hardware"], req.get("measurements", {})))):
            return r
        if policy.checks.reachability and (r := checks.reachable(req.get("multiaddrs", []))):
            return r
        return None

    def _admit(self, nid: str, policy: Admission) -> tuple[int, dict]:
        with self.live.admission_lock(), Session(self.engine) as s:
            node = s.get(Node, nid)
            now = self.live.now()
            self._sweep(s, now)
            counts = self._counts(s)
            utility = node.role == "monitor"  # the Health Monitor: no stage, no contributor slot
            if not node.operator and not utility and policy.operators_only_until_step > self._run_step(s):
                return self._wait(s, nid, "capacity", "operators only until step "
                                  f"{policy.operators_only_until_step}", 30.0)
            if not node.operator and not utility and counts.get("contributors", 0) >= policy.max_contributors:
                return self._wait(s, nid, "capacity", f"{policy.max_contributors} contributors admitted", 30.0)
            stage = None
            if node.role == "worker":
                slots = [StageSlot(n, st.role, st.layers, counts.get(f"stage:{n}", 0), policy.stage_caps.get(n))
                         for n, st in zip(self.names, self.run.stages)]
                allowed = [] if node.operator else policy.contributor_stages
                capable = node.hardware.get("vram_gb", 0) >= 2 * max(policy.min_vram_gb, 1e-9)
                stage = place(slots, allowed, capable)
                if stage is None:
                    return self._wait(s, nid, "capacity", "every allowed stage is full", 30.0)
            wait = self.live.take_join_slot(policy.joins_per_minute)
            if wait > 0:
                return self._wait(s, nid, "rate_limited", f"{policy.joins_per_minute}/min", wait)
            node.status, node.stage, node.admitted_at = "admitted", stage, now
            token = self._credential(s, node, policy)
            s.add(Decision(node_id=nid, outcome="admitted", reason="admitted", detail=stage or "", at=now))
            s.commit()
            self.live.dequeue(nid)
            self.live.set_capacity(self._counts(s))
            return 200, self._admitted_body(node, token)

    def _credential(self, s: Session, node: Node, policy: Admission) -> str:
        now = self.live.now()
        row = Serial(node_id=node.node_id, issued_at=now, expires_at=now + policy.credential_ttl_s)
        s.add(row)
        s.flush()
        node.serial, node.expires_at = row.serial, row.expires_at
        return credential.issue(self.key, run=self.run.metadata.name, node_id=node.node_id, account=node.account,
                                role=node.role, stage=node.stage or "", peer_id=node.peer_id,
                                ttl_s=policy.credential_ttl_s, serial=row.serial, operator=node.operator, now=now)

    # -- renew / leave --------------------------------------------------------------------------------
    def renew(self, token: str, peer_id: str, step: int) -> tuple[int, dict]:
        """A fresh credential for an admitted node that presents its current one; declined once banned."""
        try:
            cred = credential.verify(token, self.key.public_key(), run=self.run.metadata.name, peer_id=peer_id,
                                     banned=self.bans())
        except credential.CredentialRefused as e:
            with Session(self.engine) as s:
                reason = "banned" if e.reason == "banned" else "invalid_token"
                return self._refuse(s, None, reason, f"renewal: {e}")
        with Session(self.engine) as s:
            node = s.get(Node, cred.node_id)
            if node is None or node.status != "admitted" or node.serial != cred.serial:
                return self._refuse(s, cred.node_id, "invalid_token", "renewal: not the node's current credential")
            node.step = max(node.step, int(step))
            token = self._credential(s, node, self.policy())
            s.commit()
            return 200, self._admitted_body(node, token)

    def leave(self, node_id: str) -> None:
        with self.live.admission_lock(), Session(self.engine) as s:
            s.execute(update(Node).where(Node.node_id == node_id).values(status="left"))
            s.commit()
            self.live.dequeue(node_id)
            self.live.set_capacity(self._counts(s))

    # -- accounts and bans ----------------------------------------------------------------------------
    def add_account(self, name: str, operator: bool) -> str:
        token = secrets.token_urlsafe(24)
        with Session(self.engine) as s:
            s.merge(Account(name=name, token_hash=checks.token_hash(token), operator=operator,
                            created_at=self.live.now()))
            s.commit()
        return token

    def ban(self, subject: str, kind: str, reason: str) -> None:
        """Bar a node or a whole account: no new admission, no renewal; its nodes drop out at expiry."""
        with self.live.admission_lock(), Session(self.engine) as s:
            s.merge(Ban(subject=subject, kind=kind, reason=reason, at=self.live.now()))
            col = Node.node_id if kind == "node" else Node.account
            s.execute(update(Node).where(col == subject, Node.status == "queued").values(status="banned"))
            s.commit()

    def bans(self) -> list[str]:
        with Session(self.engine) as s:
            return list(s.scalars(select(Ban.subject)))

    # -- reports --------------------------------------------------------------------------------------
    def report(self) -> dict:
        with Session(self.engine) as s:
            rows = s.execute(select(Decision.reason, func.count()).where(Decision.outcome != "admitted")
                             .group_by(Decision.reason)).all()
            reasons = {r: n for r, n in rows}
            admitted = s.scalar(select(func.count()).select_from(Decision).where(Decision.outcome == "admitted"))
            waits = [{"node_id": n.node_id, "wait_s": round(n.admitted_at - n.requested_at, 3)}
                     for n in s.scalars(select(Node).where(Node.admitted_at.is_not(None)).order_by(Node.node_id))]
        total = sum(reasons.values())
        return {"run": self.run.metadata.name, "admitted": admitted, "refused": total, "reasons": reasons,
                "shares": {r: n / total for r, n in reasons.items()} if total else {}, "waiting": waits,
                "queue_length": self.live.queue_length(), "capacity": self.live.capacity()}

    def nodes(self) -> list[dict]:
        with Session(self.engine) as s:
            self._sweep(s, self.live.now())
            return [{"node_id": n.node_id, "peer_id": n.peer_id, "account": n.account, "role": n.role,
                     "stage": n.stage, "status": n.status, "operator": n.operator, "expires_at": n.expires_at}
                    for n in s.scalars(select(Node).order_by(Node.node_id))]

    # -- helpers --------------------------------------------------------------------------------------
    def _sweep(self, s: Session, now: float) -> None:
        """Admitted nodes whose credential ran out unrenewed free their slot."""
        if s.execute(update(Node).where(Node.status == "admitted", Node.expires_at < now)
                     .values(status="expired")).rowcount:
            s.commit()

    def _counts(self, s: Session) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in s.scalars(select(Node).where(Node.status == "admitted")):
            if not n.operator and n.role != "monitor":
                counts["contributors"] = counts.get("contributors", 0) + 1
            if n.stage:
                counts[f"stage:{n.stage}"] = counts.get(f"stage:{n.stage}", 0) + 1
        return counts

    def _run_step(self, s: Session) -> int:
        return s.scalar(select(func.max(Node.step)).where(Node.operator.is_(True))) or 0

    def _restore_queue(self) -> None:
        with Session(self.engine) as s:
            for n in s.scalars(select(Node).where(Node.status == "queued")):
                self.live.enqueue(n.node_id, n.requested_at)
            self.live.set_capacity(self._counts(s))

    def _refuse(self, s: Session, nid: Optional[str], reason: str, detail: str) -> tuple[int, dict]:
        s.add(Decision(node_id=nid, outcome="refused", reason=reason, detail=detail[:256], at=self.live.now()))
        s.commit()
        return (401 if reason == "invalid_token" else 403), {"status": "refused", "reason": reason, "detail": detail}

    def _wait(self, s: Session, nid: str, reason: str, detail: str, retry: float) -> tuple[int, dict]:
        s.add(Decision(node_id=nid, outcome="queued", reason=reason, detail=detail[:256], at=self.live.now()))
        s.commit()
        return 200, self._queued_body(nid, reason, retry, detail)

    def _queued_body(self, nid: str, reason: str, retry: float, detail: str = "") -> dict:
        return {"status": "queued", "reason": reason, "detail": detail, "position": self.live.position(nid),
                "retry_after_s": round(max(retry, 0.05), 3)}

    def _admitted_body(self, node: Node, token: str) -> dict:
        return {"status": "admitted", "reason": "", "detail": "", "stage": node.stage, "credential": token,
                "expires_at": node.expires_at, "authority_public_key": keys.public_text(self.key)}
