"""Schemathesis against the Authorizer's own OpenAPI schema, over real HTTP, on PostgreSQL + Redis (the API
layer is the same on both back ends; the contract suite covers the embedded one): whatever it sends (operator
endpoints with a valid admin credential, so they are exercised past the 401), no response is a server error."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from agoractl.auth import credential


@pytest.fixture
def served(pg_backend):
    backend = pg_backend
    s = backend.start()
    return s, {"Authorization": "Bearer " + credential.admin_token(backend.key, "run", ttl_s=3600)}


@pytest.fixture
def api(served):
    return schemathesis.openapi.from_url(served[0].url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api")


@schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_makes_a_server_error(case, served):
    case.call_and_validate(headers=served[1], checks=[not_a_server_error], timeout=60)
