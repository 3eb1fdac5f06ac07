"""The authenticated front of a Prometheus push gateway (report §3.6.3: contributors push their metrics over an
authenticated connection). The push gateway itself checks nobody; this gate, on the operator's side, accepts a
push only with ``Authorization: Bearer TOKEN`` where TOKEN is a valid credential of the run signed by the
authority (admission on; a worker's or trainer's own, as its renewal thread keeps it), or equals
``$AGORA_PUSH_TOKEN`` (admission off). Anything else is answered 401 and never reaches the gateway, so its
series never appear. Accepted requests are forwarded unchanged to the gateway (``/metrics/job/...``)."""

from __future__ import annotations

import hmac
import os
from typing import Optional

import httpx
from fastapi import FastAPI, HTTPException, Request, Response

from agoractl.auth import credential, keys
from agoractl.manifest.schema import Run
from agoractl.runtime.metrics import PUSH_TOKEN_ENV


def create_app(run: Run, upstream: str, authority_public_key: Optional[str] = None,
               push_token: Optional[str] = None) -> FastAPI:
    app = FastAPI(title="agoractl push gate", description="Authenticated pushes to a Prometheus push gateway.")
    public = keys.parse_public(authority_public_key) if run.admission.enabled and authority_public_key else None
    secret = push_token if push_token is not None else os.environ.get(PUSH_TOKEN_ENV)
    app.state.refused = 0

    def allowed(header: Optional[str]) -> bool:
        token = (header or "").removeprefix("Bearer ").strip()
        if not token:
            return False
        if run.admission.enabled:
            if public is None:
                return False
            try:
                cred = credential.verify(token, public, run=run.metadata.name)
            except credential.CredentialRefused:
                return False
            return cred.role in ("worker", "trainer")
        return bool(secret) and hmac.compare_digest(token.encode(), secret.encode())

    @app.api_route("/metrics/job/{path:path}", methods=["PUT", "POST", "DELETE"])
    async def push(path: str, request: Request) -> Response:
        if not allowed(request.headers.get("authorization")):
            app.state.refused += 1
            raise HTTPException(401, "push refused: no valid bearer token for this run")
        async with httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=30) as client:
            r = await client.request(request.method, f"/metrics/job/{path}", content=await request.body(),
                                     headers={k: v for k, v in request.headers.items() if k.lower() == "content-type"})
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    return app
