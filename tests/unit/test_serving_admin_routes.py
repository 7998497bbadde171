"""The admin API's route protection, without a database: every route but /health refuses a
request without a token before anything else happens, and the app refuses to be built with
a route that escapes the rule.

The same checks with real tokens (viewer refused on mutating routes, writer keys refused,
revoked tokens refused) run against Postgres in tests/integration/test_serving_admin.py.
"""

from __future__ import annotations

import re

import pytest
from fastapi import APIRouter, Depends
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from sqlalchemy import create_engine

from flywheel.core.settings import Settings
from serving.admin.app import PUBLIC_PATHS, check_routes_protected, create_app
from serving.admin.deps import READ_METHODS, ROLE_RANK, required_role, requires
from serving.admin.schemas import heldout_summary
from serving.admin_cli import admin_url

NO_DB = "postgresql+psycopg://nobody@127.0.0.1:1/none"


@pytest.fixture(scope="module")
def app():
    return create_app(Settings(environment="test"), engine=create_engine(NO_DB))


def concrete(path: str) -> str:
    """A path template with every parameter filled in (``{token_id}`` → ``1``)."""
    return re.sub(r"\{[^}]+\}", "1", path)


def endpoints(app) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, whatever its kind."""
    out = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            if method != "HEAD":
                out.append((method, route.path))
    return out


def test_the_app_has_the_routes_of_the_issue(app):
    paths = {(m, p) for m, p in endpoints(app)}
    for wanted in [
        ("GET", "/v1/checkpoints"),
        ("GET", "/v1/checkpoints/{checkpoint_id}"),
        ("GET", "/v1/fleet"),
        ("POST", "/v1/canary"),
        ("PUT", "/v1/canary/weight"),
        ("POST", "/v1/promote"),
        ("POST", "/v1/rollback"),
        ("POST", "/v1/trainer/pause"),
        ("POST", "/v1/trainer/resume"),
        ("POST", "/v1/canary/pause"),
        ("POST", "/v1/canary/resume"),
        ("GET", "/v1/audit"),
        ("GET", "/v1/tokens"),
        ("POST", "/v1/tokens"),
        ("DELETE", "/v1/tokens/{token_id}"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/health"),
    ]:
        assert wanted in paths


def test_every_route_but_health_refuses_a_request_without_a_token(app):
    client = TestClient(app)
    checked = 0
    for method, path in endpoints(app):
        if path in PUBLIC_PATHS:
            continue
        for headers in ({}, {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": "Bearer"}):
            response = client.request(method, concrete(path), headers=headers, json={})
            assert response.status_code == 401, (method, path, headers, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
            body = response.json()
            assert body["error"] == "unauthorized" and body["reason"], body
        checked += 1
    assert checked >= 19


def test_every_route_declares_its_role_and_mutating_ones_exclude_viewers(app):
    for route in app.routes:
        if route.path in PUBLIC_PATHS:
            continue
        assert isinstance(route, APIRoute), route.path
        role = required_role(route)
        assert role in ROLE_RANK, route.path
        if set(route.methods) - READ_METHODS:
            assert ROLE_RANK[role] >= ROLE_RANK["operator"], (route.path, role)
        if route.path.startswith("/v1/tokens"):
            assert role == "admin", route.path


def test_an_app_with_an_unprotected_route_is_refused(app):
    app2 = create_app(Settings(environment="test"), engine=create_engine(NO_DB))
    app2.get("/v1/oops")(lambda: {"open": True})
    with pytest.raises(RuntimeError, match="/v1/oops: no auth dependency"):
        check_routes_protected(app2)

    app3 = create_app(Settings(environment="test"), engine=create_engine(NO_DB))
    router = APIRouter(prefix="/v1", dependencies=[Depends(requires("viewer"))])
    router.post("/sneaky")(lambda: {})
    app3.include_router(router)
    with pytest.raises(RuntimeError, match="/v1/sneaky: mutating route open to viewer"):
        check_routes_protected(app3)


def test_health_needs_no_token_and_says_when_the_database_is_down(app):
    response = TestClient(app).get("/health")
    assert response.status_code == 503
    assert response.json()["status"] == "unavailable"


def test_openapi_documents_bearer_auth_and_error_bodies(app):
    schema = app.openapi()
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path, operations in schema["paths"].items():
        if path in PUBLIC_PATHS:
            continue
        for method, operation in operations.items():
            assert operation.get("security"), (method, path)
            assert {"401", "403"} <= set(operation["responses"]), (method, path)
    assert "/openapi.json" not in schema["paths"] and "/docs" not in schema["paths"]


def test_requires_rejects_unknown_roles():
    with pytest.raises(ValueError, match="role"):
        requires("writer")


def test_heldout_summary_prefers_the_gate():
    gate = {"passed": True, "reason": "passed: ...", "key": "k1", "candidate": {"success_rate": 0.4, "n": 32}}
    summary = heldout_summary({"heldout": {"k1": {"success_rate": 0.4, "n": 32}}, "gate": gate})
    assert (summary.success_rate, summary.n, summary.gate_passed, summary.key) == (0.4, 32, True, "k1")
    root = heldout_summary({"heldout": {"k0": {"success_rate": 0.13, "n": 200}}})
    assert (root.success_rate, root.n, root.gate_passed, root.key) == (0.13, 200, None, "k0")
    assert heldout_summary({}) is None and heldout_summary(None) is None


def test_admin_url_from_settings():
    settings = Settings(environment="test")
    assert admin_url(settings) == f"http://127.0.0.1:{settings.serving.admin_port}"
    bound_all = settings.model_copy(
        update={"serving": settings.serving.model_copy(update={"admin_host": "0.0.0.0", "admin_port": 9})}
    )
    assert admin_url(bound_all) == "http://127.0.0.1:9"
    explicit = settings.model_copy(
        update={"serving": settings.serving.model_copy(update={"admin_url": "http://ops:1/"})}
    )
    assert admin_url(explicit) == "http://ops:1"


def test_oversize_bodies_are_refused(app):
    client = TestClient(app)
    declared = client.post("/v1/promote", content=b"x" * 70_000, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and "over the limit" in declared.json()["reason"]

    def chunks():
        for _ in range(100):
            yield b"x" * 1000

    streamed = client.post("/v1/promote", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 401  # read up to the limit only, then the missing token is what is answered


@pytest.mark.parametrize("content", ["not json", "[" * 5000, '{"weight": NaN}'])
def test_no_token_wins_over_a_malformed_body(app, content):
    response = TestClient(app).put("/v1/canary/weight", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
