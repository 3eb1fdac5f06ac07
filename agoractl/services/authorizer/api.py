"""The Authorizer's HTTP API (FastAPI). Request and response bodies are pydantic models, so the OpenAPI
schema at ``/openapi.json`` is the contract clients and fuzzers read. A malformed request gets 422 with
reason ``malformed`` (and is counted); no input produces a 500.

Node endpoints: ``/v1/info``, ``/v1/ping``, ``/v1/probe``, ``/v1/join``, ``/v1/renew``, ``/v1/leave``,
``/v1/bans``. Operator endpoints need ``Authorization: Bearer <admin credential>`` (a credential with role
``admin`` signed by the authority key, minted by the CLI from ``AGORA_AUTHORITY_KEY``); ``GET /v1/nodes`` also
takes a ``monitor`` credential (the Health Monitor's, issued by ``/v1/join`` with role ``monitor``).
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from agoractl import __version__
from agoractl.auth import credential, keys
from agoractl.services.authorizer.models import Decision
from agoractl.services.authorizer.service import Authorizer, PolicyError

Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$")]
NodeId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
PeerId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[1-9A-HJ-NP-Za-km-z]+$")]
Token = Annotated[str, Field(min_length=1, max_length=credential.MAX_TOKEN_CHARS)]
Num = Annotated[float, Field(ge=0, le=1e9)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hardware(Strict):
    ram_gb: Num = 0
    vram_gb: Num = 0
    accelerator: Annotated[str, Field(max_length=128)] = ""


class Measurements(Strict):
    bandwidth_mbps: Num = 0
    latency_ms: Num = 0


class Client(Strict):
    version: Annotated[str, Field(max_length=64)] = ""
    package_hash: Annotated[str, Field(max_length=128)] = ""


class JoinRequest(Strict):
    node_id: NodeId
    account: Name = "anonymous"
    account_token: Optional[Annotated[str, Field(max_length=256)]] = None
    role: Literal["worker", "trainer", "monitor"]
    peer_id: PeerId
    multiaddrs: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=16)] = []
    hardware: Hardware = Hardware()
    measurements: Measurements = Measurements()
    client: Client = Client()
    ready: bool = False
    """True once the node has its stage's checkpoint and can serve: only then is it admitted."""


class JoinResponse(BaseModel):
    status: Literal["queued", "admitted", "refused"]
    reason: str = ""
    detail: str = ""
    position: Optional[int] = None
    retry_after_s: Optional[float] = None
    stage: Optional[str] = None
    credential: Optional[str] = None
    expires_at: Optional[float] = None
    authority_public_key: Optional[str] = None


class RenewRequest(Strict):
    credential: Token
    peer_id: PeerId
    step: Annotated[int, Field(ge=0, le=2**40)] = 0


class LeaveRequest(Strict):
    credential: Token
    peer_id: PeerId


class AccountRequest(Strict):
    name: Name
    operator: bool = False


class BanRequest(Strict):
    subject: NodeId
    kind: Literal["node", "account"] = "node"
    reason: Annotated[str, Field(max_length=256)] = ""


REFUSED = {401: {"model": JoinResponse, "description": "invalid account token or credential"},
           403: {"model": JoinResponse, "description": "refused (banned, below requirements, ...)"}}


def create_app(auth: Authorizer) -> FastAPI:
    """One app per Authorizer (tests build one per back end)."""
    app = FastAPI(title="agoractl Authorizer", version=__version__,
                  description="Admission, stage placement and signed credentials for one run (report §3.6.1).")
    public, run = auth.key.public_key(), auth.run.metadata.name

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid"}
        detail = f"{'.'.join(map(str, err['loc']))}: {err['msg']}"[:256]
        with Session(auth.engine) as s:
            s.add(Decision(node_id=None, outcome="refused", reason="malformed", detail=detail, at=auth.live.now()))
            s.commit()
        return JSONResponse({"status": "refused", "reason": "malformed", "detail": detail}, status_code=422)

    def admin(authorization: Annotated[Optional[str], Header()] = None) -> None:
        token = (authorization or "").removeprefix("Bearer ").strip()
        try:
            credential.verify(token, public, run=run, role="admin")
        except credential.CredentialRefused as e:
            raise HTTPException(401, f"admin credential refused: {e.reason}") from None

    def reader(authorization: Annotated[Optional[str], Header()] = None) -> None:
        """An operator's admin credential, or an admitted Health Monitor's (read-only endpoints)."""
        token = (authorization or "").removeprefix("Bearer ").strip()
        try:
            credential.verify(token, public, run=run, role=("admin", "monitor"), banned=auth.bans())
        except credential.CredentialRefused as e:
            raise HTTPException(401, f"admin or monitor credential refused: {e.reason}") from None

    Admin, Reader = Depends(admin), Depends(reader)
    ADMIN = {401: {"description": "missing or invalid admin credential"}}

    @app.get("/v1/info")
    def info() -> dict:
        return {"run": run, "authority_public_key": keys.public_text(public), "authority": keys.key_id(public),
                "stages": auth.names, "version": __version__}

    @app.get("/v1/ping")
    def ping() -> dict:
        return {"ok": True}

    @app.get("/v1/probe", response_class=Response, responses={200: {"content": {"application/octet-stream": {}}}})
    def probe(size: Annotated[int, Query(ge=1, le=16 << 20)] = 1 << 20) -> Response:
        return Response(bytes(size), media_type="application/octet-stream")

    def answer(result: tuple[int, dict], response: Response) -> JoinResponse:
        response.status_code = result[0]
        return JoinResponse(**result[1])

    @app.post("/v1/join", responses=REFUSED)
    def join(body: JoinRequest, response: Response) -> JoinResponse:
        return answer(auth.join(body.model_dump()), response)

    @app.post("/v1/renew", responses=REFUSED)
    def renew(body: RenewRequest, response: Response) -> JoinResponse:
        return answer(auth.renew(body.credential, body.peer_id, body.step), response)

    @app.post("/v1/leave", responses={401: {"description": "credential refused"}})
    def leave(body: LeaveRequest) -> dict:
        try:
            cred = credential.verify(body.credential, public, run=run, peer_id=body.peer_id)
        except credential.CredentialRefused as e:
            raise HTTPException(401, f"credential refused: {e.reason}") from None
        auth.leave(cred.node_id)
        return {"ok": True}

    @app.get("/v1/bans")
    def bans() -> dict:
        return {"bans": auth.bans()}

    @app.post("/v1/bans", responses=ADMIN, dependencies=[Admin])
    def ban(body: BanRequest) -> dict:
        auth.ban(body.subject, body.kind, body.reason)
        return {"ok": True}

    @app.post("/v1/accounts", responses=ADMIN, dependencies=[Admin])
    def account(body: AccountRequest) -> dict:
        return {"name": body.name, "token": auth.add_account(body.name, body.operator)}

    @app.get("/v1/policy", responses=ADMIN, dependencies=[Admin])
    def get_policy() -> dict:
        return auth.policy().model_dump()

    @app.patch("/v1/policy", responses={**ADMIN, 400: {"description": "invalid policy"}}, dependencies=[Admin])
    def set_policy(changes: dict) -> dict:
        try:
            return auth.set_policy(changes).model_dump()
        except PolicyError as e:
            raise HTTPException(400, str(e)) from None

    @app.get("/v1/report", responses=ADMIN, dependencies=[Admin])
    def report() -> dict:
        return auth.report()

    @app.get("/v1/nodes", responses=ADMIN, dependencies=[Reader])
    def nodes() -> list[dict]:
        return auth.nodes()

    return app
