"""The admin API against real Postgres: authentication and roles on every route, the registry,
deployment errors and their mapping, pause flags, tokens and the audit log.

The deployment routes run the real ``serving.fleet.deploy`` functions. Without vLLM replicas they
are driven into their refusals (unknown, rejected or undeployable checkpoint, no canary, no
stable) and into a real failed swap (replicas registered as serving whose server is gone);
the happy path through real replicas is in tests/integration/test_serving_admin_e2e.py.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import JSON_VALUES, schemathesis_sweep
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import strategies as st
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from flywheel.core.auth import create_key, revoke_key
from flywheel.core.db import migrate
from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import AuditLog, Checkpoint, Deployment, Replica
from flywheel.core.settings import ServingSettings, Settings
from flywheel.stack import endpoints
from serving.admin.app import PUBLIC_PATHS, create_app
from serving.admin.deps import READ_METHODS, ROLE_RANK, required_role
from serving.admin.tokens import BootstrapRefused, bootstrap_admin_token

pytestmark = pytest.mark.integration


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def db_url(pg_url: str) -> Iterator[str]:
    """A fresh, migrated database of this module (dropped afterwards)."""
    url = endpoints.with_database(pg_url, f"admin_scratch_{uuid.uuid4().hex[:10]}")
    endpoints.ensure_database(url)
    migrate.upgrade(url)
    yield url
    get_engine(url).dispose()
    endpoints.drop_database(url)


@pytest.fixture(scope="module")
def engine(db_url: str):
    return get_engine(db_url)


@pytest.fixture(scope="module")
def tokens(engine) -> dict[str, str]:
    """A token of every role, plus a revoked viewer token and a gateway write key."""
    out = {}
    with Session(engine) as session:
        for role in ("viewer", "operator", "admin"):
            out[role] = create_key(session, name=role, role=role, created_by="test")[1]
        out["writer"] = create_key(session, name="gateway", role="writer", project="p1")[1]
        info, out["revoked"] = create_key(session, name="old-viewer", role="viewer")
        revoke_key(session, info.id)
        session.commit()
    return out


def make_settings(fleet: str) -> Settings:
    return Settings(environment="test", serving=ServingSettings(fleet=fleet))


@pytest.fixture
def fleet() -> str:
    """A fleet name of this test alone (deployments and replicas do not leak between tests)."""
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def client(engine, fleet: str) -> TestClient:
    return TestClient(create_app(make_settings(fleet), engine))


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def audit_rows(engine, **where: Any) -> list[AuditLog]:
    with Session(engine) as session:
        query = select(AuditLog).order_by(AuditLog.id)
        for column, value in where.items():
            query = query.where(getattr(AuditLog, column) == value)
        return list(session.scalars(query))


def last_audit_id(engine) -> int:
    rows = audit_rows(engine)
    return rows[-1].id if rows else 0


def audit_since(engine, after_id: int) -> list[AuditLog]:
    return [r for r in audit_rows(engine) if r.id > after_id]


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "1", path)


def protected_endpoints(app) -> list[tuple[str, str, APIRoute]]:
    out = []
    for route in app.routes:
        if route.path in PUBLIC_PATHS:
            continue
        assert isinstance(route, APIRoute), f"{route.path} is not an APIRoute (cannot carry the auth dependency)"
        out += [(method, route.path, route) for method in sorted(route.methods) if method != "HEAD"]
    return out


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def add_checkpoint(
    engine,
    checkpoint_id: str,
    *,
    parent: str | None,
    path: str,
    status: str = "candidate",
    success: float | None = None,
) -> None:
    eval_ = {}
    if success is not None:
        candidate = {"success_rate": success, "n": 32}
        eval_ = {
            "heldout": {"k": candidate},
            "gate": {"passed": True, "reason": "passed", "key": "k", "candidate": candidate},
        }
    with Session(engine) as session:
        session.add(
            Checkpoint(
                id=checkpoint_id,
                policy_version=checkpoint_id,
                parent_id=parent,
                base_model=path,
                path=path,
                format="full",
                status=status,
                status_reason=f"{status} in a test",
                n_samples=10,
                eval=eval_,
            )
        )
        session.commit()


@pytest.fixture(scope="module")
def base_id(engine, base_model_dir: Path) -> str:
    from flywheel.core.settings import get_settings
    from flywheel.model.register import register_base_model

    with Session(engine) as session:
        return register_base_model(session, get_settings().model, base_model_dir)


def stable_fleet(engine, fleet: str, base_id: str, urls: list[str]) -> int:
    """A fleet serving the base as stable on replicas registered at ``urls`` (state serving)."""
    with Session(engine) as session:
        stable = Deployment(
            fleet=fleet,
            checkpoint_id=base_id,
            role="stable",
            weight=1.0,
            strategy="full",
            status="active",
            created_by="test",
        )
        session.add(stable)
        session.flush()
        for url in urls:
            session.add(
                Replica(
                    fleet=fleet,
                    url=url,
                    state="serving",
                    policy_version=base_id,
                    checkpoint_id=base_id,
                    deployment_id=stable.id,
                )
            )
        session.commit()
        return stable.id


# --------------------------------------------------------------------------- authentication and roles


def test_health_needs_no_token(client):
    response = client.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_every_route_refuses_missing_unknown_revoked_and_writer_tokens(client, tokens):
    checked = 0
    for method, path, _route in protected_endpoints(client.app):
        url = concrete(path)
        for headers, fragment in (
            ({}, "missing token"),
            (bearer("fwo_" + "x" * 32), "unknown token"),
            (bearer(tokens["revoked"]), "revoked"),
        ):
            response = client.request(method, url, headers=headers, json={})
            assert response.status_code == 401, (method, path, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
            assert fragment in response.json()["reason"], response.json()
        response = client.request(method, url, headers=bearer(tokens["writer"]), json={})
        assert response.status_code == 403, (method, path, response.text)
        assert "write key" in response.json()["reason"]
        checked += 1
    assert checked >= 19


def test_each_route_refuses_roles_below_its_own(engine, client, tokens):
    before = last_audit_id(engine)
    refused_mutations = 0
    for method, path, route in protected_endpoints(client.app):
        needed = required_role(route)
        for role in ("viewer", "operator"):
            if ROLE_RANK[role] >= ROLE_RANK[needed]:
                continue
            response = client.request(method, concrete(path), headers=bearer(tokens[role]), json={})
            assert response.status_code == 403, (role, method, path, response.text)
            body = response.json()
            assert body["required_role"] == needed and f"needs the {needed} role" in body["reason"], body
            if method not in READ_METHODS:
                refused_mutations += 1
        if method not in READ_METHODS:
            assert ROLE_RANK[needed] >= ROLE_RANK["operator"], path
    assert refused_mutations >= 12
    rows = [r for r in audit_since(engine, before) if not r.success]
    assert len(rows) == refused_mutations  # every refused mutating call is in the audit log, reads are not
    assert {r.actor for r in rows} == {"token:viewer", "token:operator"}
    assert all(r.details["status"] == 403 and r.details["token_id"] for r in rows)


def test_unauthenticated_mutating_calls_are_audited_as_anonymous(engine, client):
    before = last_audit_id(engine)
    assert client.post("/v1/promote").status_code == 401
    assert client.get("/v1/fleet").status_code == 401
    [row] = audit_since(engine, before)
    assert (row.actor, row.action, row.success, row.details["status"]) == ("anonymous", "deploy.promote", False, 401)


def test_openapi_and_docs_need_a_viewer_token(client, tokens):
    assert client.get("/openapi.json").status_code == 401
    assert client.get("/docs").status_code == 401
    schema = client.get("/openapi.json", headers=bearer(tokens["viewer"]))
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert {"/v1/checkpoints", "/v1/canary", "/v1/promote", "/v1/rollback", "/v1/tokens", "/v1/audit"} <= set(paths)
    docs = client.get("/docs", headers=bearer(tokens["viewer"]))
    assert docs.status_code == 200 and "/openapi.json" in docs.text


def test_use_of_a_token_is_recorded(engine, client, tokens):
    from flywheel.core.auth import find_key

    assert client.get("/v1/trainer", headers=bearer(tokens["viewer"])).status_code == 200
    with Session(engine) as session:
        assert find_key(session, tokens["viewer"]).last_used_at is not None


# --------------------------------------------------------------------------- checkpoints


def test_checkpoints_list_pages_newest_first_and_show(engine, client, tokens, base_id):
    parent = f"ck-{uuid.uuid4().hex[:6]}"
    child = f"ck-{uuid.uuid4().hex[:6]}"
    add_checkpoint(engine, parent, parent=base_id, path="/nowhere/a", success=0.25)
    add_checkpoint(engine, child, parent=parent, path="/nowhere/b", status="rejected", success=0.1)
    viewer = bearer(tokens["viewer"])

    page = client.get("/v1/checkpoints", params={"limit": 2}, headers=viewer).json()
    assert page["total"] >= 3 and page["limit"] == 2 and len(page["items"]) == 2
    assert [i["id"] for i in page["items"]] == [child, parent]
    first = page["items"][1]
    assert first["parent_id"] == base_id and first["policy_version"] == parent and first["status"] == "candidate"
    assert first["heldout"]["success_rate"] == 0.25 and first["heldout"]["gate_passed"] is True
    assert first["created_at"]
    second = client.get("/v1/checkpoints", params={"limit": 2, "offset": 2}, headers=viewer).json()
    assert base_id in [i["id"] for i in second["items"]]
    rejected = client.get("/v1/checkpoints", params={"status": "rejected"}, headers=viewer).json()
    assert child in [i["id"] for i in rejected["items"]] and all(i["status"] == "rejected" for i in rejected["items"])

    detail = client.get(f"/v1/checkpoints/{parent}", headers=viewer).json()
    assert detail["path"] == "/nowhere/a" and detail["eval"]["gate"]["passed"] is True and "metrics" in detail
    missing = client.get("/v1/checkpoints/nope", headers=viewer)
    assert missing.status_code == 404 and missing.json() == {
        "error": "not_found",
        "reason": "no checkpoint 'nope' in the registry",
    }
    bad = client.get("/v1/checkpoints", params={"limit": 0, "status": "shiny"}, headers=viewer)
    assert bad.status_code == 422 and "query.limit" in bad.json()["reason"] and "query.status" in bad.json()["reason"]


# --------------------------------------------------------------------------- deployment routes: errors and audit


def test_deploy_refusals_map_to_http_and_are_audited_once(engine, client, tokens, base_id, fleet, unused_port):
    operator = bearer(tokens["operator"])
    rejected = f"ck-{uuid.uuid4().hex[:6]}"
    add_checkpoint(engine, rejected, parent=base_id, path="/nowhere/r", status="rejected")
    canary, weight, pin = "deploy.canary", "deploy.weight", "deploy.pin"

    cases = [
        ("POST", "/v1/canary", {"checkpoint_id": "nope", "weight": 0.05}, 404, "not_found", "no checkpoint 'nope'",
         "deploy", canary),
        ("POST", "/v1/canary", {"checkpoint_id": rejected, "weight": 0.05}, 422, "invalid", "is rejected", "deploy",
         canary),
        ("POST", "/v1/canary", {"checkpoint_id": base_id, "weight": 1.5}, 422, "invalid", "body.weight", "api", canary),
        ("POST", "/v1/canary", {"checkpoint_id": base_id, "wieght": 0.5}, 422, "invalid", "body.wieght", "api", canary),
        ("PUT", "/v1/canary/weight", {"weight": 0.5}, 409, "conflict", "no active canary", "deploy", weight),
        ("PUT", "/v1/canary/weight", {"weight": 0}, 422, "invalid", "body.weight", "api", weight),
        ("POST", "/v1/promote", {}, 409, "conflict", "no active canary to promote", "deploy", "deploy.promote"),
        ("POST", "/v1/rollback", {"to_checkpoint_id": base_id}, 409, "conflict", "no active stable", "deploy",
         "deploy.rollback"),
        ("PUT", "/v1/pins/subagent", {"checkpoint_id": base_id}, 409, "conflict", "no active stable", "deploy", pin),
        ("PUT", "/v1/pins/agent", {"checkpoint_id": base_id}, 409, "conflict", "is trained", "deploy", pin),
        ("PUT", "/v1/pins/subagent", {"checkpoint_id": "nope"}, 404, "not_found", "no checkpoint 'nope'", "deploy",
         pin),
        ("PUT", "/v1/pins/sub%20agent", {"checkpoint_id": base_id}, 422, "invalid", "agent_role", "api", pin),
        ("PUT", "/v1/pins/subagent", {"checkpoint": base_id}, 422, "invalid", "body.checkpoint", "api", pin),
        ("DELETE", "/v1/pins/subagent", None, 404, "not_found", "is not pinned", "deploy", "deploy.unpin"),
    ]  # fmt: skip
    for method, path, body, status, kind, fragment, writer, action in cases:
        before = last_audit_id(engine)
        response = client.request(method, path, json=body, headers=operator)
        assert response.status_code == status, (path, body, response.text)
        answer = response.json()
        assert answer["error"] == kind and fragment in answer["reason"], answer
        [row] = audit_since(engine, before)  # one row: the deploy function's, or the API's when it never got there
        assert row.success is False and row.actor == "token:operator" and row.target == f"fleet:{fleet}", row.details
        assert row.action == action, (path, row.action)
        if writer == "api":
            assert row.details["status"] == status and fragment in row.details["reason"]
        else:
            assert row.details["error"] == kind and row.details["token_id"]
    stable_fleet(engine, fleet, base_id, [f"http://127.0.0.1:{unused_port()}"])
    response = client.put("/v1/pins/subagent", json={"checkpoint_id": base_id}, headers=operator)
    assert response.status_code == 409 and "would leave no stable replica" in response.json()["reason"]
    assert client.get("/v1/fleet", headers=operator).json()["pins"] == []


def test_a_full_weight_canary_needs_a_spare_replica(engine, client, tokens, base_id, fleet, base_model_dir):
    from serving.fleet.registry import ensure_fleet

    ensure_fleet(engine, make_settings(fleet), urls=[dead_url()], model_dir=base_model_dir)
    candidate = f"ck-{uuid.uuid4().hex[:6]}"
    add_checkpoint(engine, candidate, parent=base_id, path=str(base_model_dir))
    response = client.post(
        "/v1/canary", json={"checkpoint_id": candidate, "weight": 0.1}, headers=bearer(tokens["operator"])
    )
    assert response.status_code == 409 and "would leave no stable replica" in response.json()["reason"]


def follow(client: TestClient, token: str, operation_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Read an operation until it ends."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = client.get(f"/v1/operations/{operation_id}", headers=bearer(token))
        assert answer.status_code == 200, answer.text
        op = answer.json()
        if op["state"] in ("succeeded", "failed"):
            return op
        assert time.monotonic() < deadline, op
        time.sleep(0.2)


def test_a_failed_swap_fails_the_operation_502_with_wait_and_the_canary_ends_failed(
    engine, client, tokens, base_id, fleet, base_model_dir, tmp_path
):
    urls = [dead_url(), dead_url()]
    stable_fleet(engine, fleet, base_id, urls)
    candidate = f"ck-{uuid.uuid4().hex[:6]}"
    shutil.copytree(base_model_dir, tmp_path / candidate)
    add_checkpoint(engine, candidate, parent=base_id, path=str(tmp_path / candidate))
    body = {"checkpoint_id": candidate, "weight": 0.1}

    before = last_audit_id(engine)
    accepted = client.post("/v1/canary", json=body, headers=bearer(tokens["operator"]))
    assert accepted.status_code == 202, accepted.text  # accepted at once: the swap runs in the background
    op = accepted.json()
    assert accepted.headers["location"] == f"/v1/operations/{op['id']}"
    assert (op["kind"], op["state"], op["actor"], op["fleet"]) == ("deploy.canary", "queued", "token:operator", fleet)
    assert op["params"] == body and op["result"] is None and op["lease_s"] == 30.0
    op = follow(client, tokens["viewer"], op["id"])
    assert op["state"] == "failed" and op["error"] == "failed", op
    assert urls[-1] in op["reason"] and "unreachable" in op["reason"]
    created, started, finished = (datetime.fromisoformat(op[k]) for k in ("created_at", "started_at", "finished_at"))
    assert created <= started <= finished
    with Session(engine) as session:
        row = session.scalars(select(Deployment).where(Deployment.fleet == fleet, Deployment.role == "canary")).one()
        assert row.status == "failed" and row.created_by == "token:operator"
    [deploy_row] = [r for r in audit_since(engine, before) if r.action == "deploy.canary"]
    assert deploy_row.success is False and deploy_row.details["error"] == "failed"
    assert deploy_row.details["operation_id"] == op["id"] and deploy_row.actor == "token:operator"
    fleet_now = client.get("/v1/fleet", headers=bearer(tokens["viewer"])).json()
    assert fleet_now["canary"] is None and fleet_now["stable"]["checkpoint_id"] == base_id
    assert {r["url"] for r in fleet_now["replicas"]} == set(urls)

    with Session(engine) as session:  # the replica the swap marked failed comes back (still unreachable)
        session.execute(update(Replica).where(Replica.fleet == fleet).values(state="serving"))
        session.commit()
    before = last_audit_id(engine)
    waited = client.post("/v1/canary", params={"wait": "true"}, json=body, headers=bearer(tokens["operator"]))
    assert waited.status_code == 502, waited.text  # the synchronous answer: the failure's own status
    error = waited.json()
    assert error["error"] == "failed" and urls[-1] in error["reason"] and error["operation_id"] != op["id"]
    again = client.get(f"/v1/operations/{error['operation_id']}", headers=bearer(tokens["viewer"])).json()
    assert (again["state"], again["reason"]) == ("failed", error["reason"])
    [row] = [r for r in audit_since(engine, before) if r.action == "deploy.canary"]  # not audited twice
    assert (row.action, row.success, row.details["operation_id"]) == ("deploy.canary", False, error["operation_id"])
    listed = client.get("/v1/operations", params={"fleet": fleet}, headers=bearer(tokens["viewer"])).json()["items"]
    assert [i["id"] for i in listed] == [error["operation_id"], op["id"]]  # newest first


def test_fleet_and_status_views(client, tokens, engine, base_id, fleet):
    viewer = bearer(tokens["viewer"])
    empty = client.get("/v1/fleet", headers=viewer).json()
    assert empty == {"fleet": fleet, "stable": None, "canary": None, "replicas": [], "pins": []}
    stable_fleet(engine, fleet, base_id, [dead_url()])
    fleet_now = client.get("/v1/fleet", headers=viewer).json()
    assert fleet_now["stable"]["checkpoint_id"] == base_id and fleet_now["stable"]["weight"] == 1.0
    assert fleet_now["replicas"][0]["state"] == "serving"
    status = client.get("/v1/status", headers=viewer).json()
    assert status["fleet"]["stable"]["id"] == fleet_now["stable"]["id"]
    assert set(status) == {"fleet", "trainer", "canary_controller"}
    canary = client.get("/v1/canary", headers=viewer).json()
    assert canary["fleet"] == fleet and canary["canary"] is None and canary["stable"]["checkpoint_id"] == base_id


# --------------------------------------------------------------------------- pause flags


@pytest.mark.parametrize("what,action", [("trainer", "trainer"), ("canary", "canary")])
def test_pause_and_resume_are_audited_under_the_token(engine, client, tokens, what, action):
    operator = bearer(tokens["operator"])
    before = last_audit_id(engine)
    paused = client.post(f"/v1/{what}/pause", json={"reason": "incident 42"}, headers=operator)
    assert paused.status_code == 200, paused.text
    assert paused.json()["paused"] is True and paused.json()["actor"] == "token:operator"
    view = client.get("/v1/status", headers=bearer(tokens["viewer"])).json()
    assert view["trainer" if what == "trainer" else "canary_controller"]["paused"] is True
    resumed = client.post(f"/v1/{what}/resume", headers=operator)
    assert resumed.status_code == 200 and resumed.json()["paused"] is False
    rows = audit_since(engine, before)
    assert [(r.action, r.actor, r.success) for r in rows] == [
        (f"{action}.pause", "token:operator", True),
        (f"{action}.resume", "token:operator", True),
    ]
    assert rows[0].details["reason"] == "incident 42" and rows[0].before == {"paused": False}
    bad = client.post(f"/v1/{what}/pause", json={"reason": "x" * 600}, headers=operator)
    assert bad.status_code == 422 and "body.reason" in bad.json()["reason"]
    assert audit_since(engine, rows[-1].id)[-1].success is False


# --------------------------------------------------------------------------- tokens


def test_token_lifecycle_through_the_api(engine, client, tokens):
    admin = bearer(tokens["admin"])
    name = f"ci-{uuid.uuid4().hex[:6]}"
    before = last_audit_id(engine)

    created = client.post("/v1/tokens", json={"name": name, "role": "operator"}, headers=admin)
    assert created.status_code == 201, created.text
    new = created.json()
    assert new["token"].startswith("fwo_") and new["token"].startswith(new["token_prefix"]) and new["active"]
    assert client.get("/v1/fleet", headers=bearer(new["token"])).status_code == 200

    listed = client.get("/v1/tokens", headers=admin).json()["items"]
    mine = [t for t in listed if t["id"] == new["id"]]
    assert mine and "token" not in mine[0] and mine[0]["role"] == "operator"
    assert all("token" not in t and "token_hash" not in t for t in listed)

    dup = client.post("/v1/tokens", json={"name": name, "role": "viewer"}, headers=admin)
    assert dup.status_code == 409 and "already named" in dup.json()["reason"]
    for body, field in (
        ({"name": "has space", "role": "viewer"}, "body.name"),
        ({"name": "w", "role": "writer"}, "body.role"),
    ):
        bad = client.post("/v1/tokens", json=body, headers=admin)
        assert bad.status_code == 422 and field in bad.json()["reason"], bad.json()

    revoked = client.delete(f"/v1/tokens/{new['id']}", headers=admin)
    assert revoked.status_code == 200 and revoked.json()["active"] is False
    refused = client.get("/v1/fleet", headers=bearer(new["token"]))
    assert refused.status_code == 401 and "revoked" in refused.json()["reason"]
    assert client.delete("/v1/tokens/999999999", headers=admin).status_code == 404

    rows = audit_since(engine, before)
    assert [(r.action, r.success) for r in rows] == [
        ("token.create", True),
        ("token.create", False),
        ("token.create", False),
        ("token.create", False),
        ("token.revoke", True),
        ("token.revoke", False),
    ]
    assert all(r.actor == "token:admin" for r in rows)
    assert rows[0].target == f"api_key:{new['id']}" and rows[0].after["name"] == name
    assert rows[4].before["active"] is True and rows[4].after["active"] is False
    assert new["token"] not in json.dumps([[r.before, r.after, r.details] for r in rows], default=str)


def test_the_first_admin_bootstrap_applies_only_without_an_admin(engine, tokens):
    with pytest.raises(BootstrapRefused, match="an active admin token exists"):
        bootstrap_admin_token(engine, "root", "cli:test")


# --------------------------------------------------------------------------- audit log


def test_audit_log_filters(engine, client, tokens):
    viewer = bearer(tokens["viewer"])
    client.post("/v1/trainer/pause", headers=bearer(tokens["operator"]))
    client.post("/v1/trainer/resume", headers=bearer(tokens["operator"]))
    client.post("/v1/promote", headers=viewer)  # refused: audited as a failure

    page = client.get("/v1/audit", params={"action": "trainer.resume", "limit": 1}, headers=viewer).json()
    assert len(page["items"]) == 1 and page["items"][0]["action"] == "trainer.resume" and page["limit"] == 1
    failed = client.get("/v1/audit", params={"success": "false", "actor": "token:viewer"}, headers=viewer).json()[
        "items"
    ]
    assert failed and all(not i["success"] and i["actor"] == "token:viewer" for i in failed)
    assert failed[0]["action"] == "deploy.promote"  # newest first
    prefixed = client.get("/v1/audit", params={"action_prefix": "trainer."}, headers=viewer).json()["items"]
    assert prefixed and all(i["action"].startswith("trainer.") for i in prefixed)
    ids = [i["id"] for i in client.get("/v1/audit", headers=viewer).json()["items"]]
    assert ids == sorted(ids, reverse=True)
    bad = client.get("/v1/audit", params={"since": "yesterday"}, headers=viewer)
    assert bad.status_code == 422 and "query.since" in bad.json()["reason"]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "method,path,content,status,fragment",
    [
        ("POST", "/v1/canary", '{"checkpoint_id": "a\\u0000b", "weight": 0.1}', 422, "body.checkpoint_id"),
        ("POST", "/v1/trainer/pause", '{"reason": "a\\u0000b"}', 422, "body.reason"),
        ("POST", "/v1/rollback", '{"to_checkpoint_id": "x y"}', 422, "body.to_checkpoint_id"),
        ("PUT", "/v1/canary/weight", '{"weight": NaN}', 422, "body.weight"),
        ("PUT", "/v1/canary/weight", '{"weight": "lots"}', 422, "body.weight"),
        ("POST", "/v1/canary", "not json", 422, "JSON decode error"),
        ("POST", "/v1/canary", "[1, 2]", 422, "body"),
        ("POST", "/v1/canary", "[" * 60000, 400, "error parsing the body"),
        ("POST", "/v1/canary", '{"checkpoint_id": "' + "x" * 70000 + '"}', 413, "over the limit"),
        ("GET", "/v1/audit?actor=%00", None, 422, "query.actor"),
        ("GET", "/v1/checkpoints/a%00b", None, 422, "path.checkpoint_id"),
        ("GET", "/v1/audit?limit=100000000000000000000", None, 422, "query.limit"),
        ("DELETE", "/v1/tokens/99999999999999999999999", None, 422, "path.token_id"),
        ("GET", "/v1/audit?since=0.0", None, 422, "query.since: Value error, expected an ISO 8601"),
        ("GET", "/v1/audit?action_prefix=a&action_prefix=b", None, 422, "query.action_prefix: given 2 times"),
    ],
)
def test_bad_input_is_refused_naming_what_is_wrong(client, tokens, method, path, content, status, fragment):
    headers = {**bearer(tokens["admin"]), "content-type": "application/json"}
    response = client.request(method, path, content=content, headers=headers)
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"] and fragment in body["reason"], body


def test_a_streamed_oversize_body_is_refused(client, tokens):
    def chunks():
        for _ in range(100):
            yield b"x" * 1000

    headers = {**bearer(tokens["operator"]), "content-type": "application/json"}
    response = client.post("/v1/promote", content=chunks(), headers=headers)
    assert response.status_code == 413 and "over the limit of 65536 bytes" in response.json()["reason"]


# -- generated requests to every documented operation (kept last: it pauses and creates things) ----

PRINTABLE = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)


def _body_schema(spec: dict[str, Any], operation: dict[str, Any]) -> dict[str, Any]:
    schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    if "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def test_generated_requests_to_every_operation_never_get_a_5xx_and_refusals_say_why(client, tokens, fault_figures):
    """Every operation of the admin API's OpenAPI, called with generated path values, query
    parameters and bodies (the schema's own fields with any JSON values, or any JSON at all) under
    an admin token: no 5xx, and every refusal is the API's error body with a reason."""
    from urllib.parse import quote

    from hypothesis import HealthCheck, given
    from hypothesis import settings as hypothesis_settings

    admin = bearer(tokens["admin"])
    spec = client.get("/openapi.json", headers=admin).json()
    operations = [(method.upper(), path, op) for path, item in spec["paths"].items() for method, op in item.items()
                  if method in ("get", "post", "put", "delete", "patch")]  # fmt: skip
    assert len(operations) >= 15
    seen = {"tried": 0, "server_errors": 0, "refused": 0}
    hit: set[tuple[str, str]] = set()

    @hypothesis_settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        method, path, op = data.draw(st.sampled_from(operations))
        ids = st.integers(min_value=10**6, max_value=2**40) | PRINTABLE.filter(bool)  # never an existing token's id
        url = re.sub(r"\{[^}]+\}", lambda _m: quote(str(data.draw(ids)), safe=""), path)
        params = {p["name"]: data.draw(PRINTABLE | st.integers() | st.booleans())
                  for p in op.get("parameters", []) if p["in"] == "query" and data.draw(st.booleans())}  # fmt: skip
        fields = _body_schema(spec, op).get("properties", {})
        body = data.draw(st.fixed_dictionaries({}, optional={k: JSON_VALUES for k in fields}) | JSON_VALUES)
        response = client.request(method, url, params=params, json=body, headers=admin)
        seen["tried"] += 1
        hit.add((method, path))
        seen["server_errors"] += response.status_code >= 500
        assert response.status_code < 500, (method, url, params, body, response.text)
        if response.status_code >= 400:
            seen["refused"] += 1
            error = response.json()
            assert error["error"] and error["reason"], (method, url, error)

    try:
        one()
    finally:
        for what in ("trainer", "canary"):  # whatever the generated calls paused
            client.post(f"/v1/{what}/resume", headers=admin)
    fault_figures(unit="requests", bad_inputs=seen["refused"], server_errors=seen["server_errors"])
    assert seen["server_errors"] == 0
    assert len(hit) >= len(operations) * 0.8, sorted(set((m, p) for m, p, _ in operations) - hit)


def test_schemathesis_on_the_admin_api_finds_no_5xx_and_every_refusal_says_why(engine, fleet, tokens, fault_figures):
    """schemathesis over the admin API's own OpenAPI, valid and schema-violating inputs, under an
    admin token (see ``conftest.schemathesis_sweep`` for the checks)."""
    import schemathesis

    admin = bearer(tokens["admin"])
    app = create_app(make_settings(fleet), engine)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=admin)
    assert len(list(schema.get_all_operations())) >= 15
    try:
        seen, failures, unnegatable = schemathesis_sweep(schema, admin)
    finally:
        for what in ("trainer", "canary"):  # whatever the generated calls paused
            TestClient(app).post(f"/v1/{what}/resume", headers=admin)
    fault_figures(unit="requests", bad_inputs=seen["refused"], server_errors=seen["server_errors"])
    assert not failures, "\n\n".join(failures)
    assert seen["server_errors"] == 0 and seen["refused"] > 50, seen
    assert len(unnegatable) <= 8, unnegatable  # the parameterless reads
