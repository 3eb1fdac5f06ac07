"""The operator's client of a running Authorizer (``agoractl auth ...``): each call carries a short-lived
admin credential signed with the authority key from ``AGORA_AUTHORITY_KEY``."""

from __future__ import annotations

from typing import Any, Optional

import httpx

from agoractl.auth import credential, keys
from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.schema import Run


def authorizer_url(run: Run, override: Optional[str]) -> str:
    url = override or run.admission.authorizer
    if not url:
        raise UsageError("no Authorizer URL: admission.authorizer is null and --authorizer was not given",
                         hint="pass --authorizer http://HOST:PORT (what `agoractl launch authorizer` printed)")
    return url.rstrip("/")


class AdminClient:
    def __init__(self, run: Run, url: str, key_path: Optional[str] = None) -> None:
        self.url, self.run = url, run
        self.token = credential.admin_token(keys.load_private(key_path), run.metadata.name)

    def call(self, method: str, path: str, json: Any = None) -> Any:
        try:
            r = httpx.request(method, self.url + path, json=json, timeout=30,
                              headers={"Authorization": f"Bearer {self.token}"})
        except httpx.HTTPError as e:
            raise RuntimeFailure(f"Authorizer {self.url}: {e}",
                                 hint="is `agoractl launch authorizer` running there?") from None
        if r.status_code == 401:
            raise RuntimeFailure(f"Authorizer {self.url}: {r.json().get('detail', 'refused')}",
                                 hint="AGORA_AUTHORITY_KEY must be the key this Authorizer runs with, "
                                      "and the manifest's metadata.name its run")
        if r.status_code >= 400:
            detail = r.json().get("detail", r.text) if r.headers.get("content-type", "").startswith(
                "application/json") else r.text
            raise UsageError(f"Authorizer {self.url}: {detail}") if r.status_code < 500 else RuntimeFailure(
                f"Authorizer {self.url}: HTTP {r.status_code}")
        return r.json()
