"""The ``flywheel`` serving commands against a real admin API (uvicorn on a free port) and Postgres.

The CLI talks only HTTP to the server (the bootstrap of the first admin token excepted), so
these tests also prove that each command's action lands in the audit log under the token's
name. The happy path of deploy/promote/rollback through real vLLM replicas is in
tests/integration/test_serving_admin_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import uvicorn
from sqlalchemy import select
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from flywheel.cli import app as cli_app
from flywheel.core.db import migrate
from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import AuditLog, Checkpoint
from flywheel.core.settings import ServingSettings, Settings, get_settings
from flywheel.stack import endpoints
from serving.admin.app import create_app

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def db_url(pg_url: str) -> Iterator[str]:
    url = endpoints.with_database(pg_url, f"admin_cli_{uuid.uuid4().hex[:10]}")
    endpoints.ensure_database(url)
    migrate.upgrade(url)
    yield url
    get_engine(url).dispose()
    endpoints.drop_database(url)


@pytest.fixture(scope="module")
def fleet() -> str:
    return f"cli-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def server(db_url: str, fleet: str) -> Iterator[str]:
    """A real admin API server on a free port; yields its URL."""
    from conftest import free_port

    port = free_port()
    settings = Settings(environment="test", serving=ServingSettings(fleet=fleet, admin_port=port))
    config = uvicorn.Config(create_app(settings, get_engine(db_url)), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        raise RuntimeError(f"admin API did not start on {url}")
    yield url
    srv.should_exit = True
    thread.join(timeout=10)


def flywheel(*args: str, env: dict[str, str] | None = None, tmp_run: Path | None = None):
    """Run the real ``flywheel`` CLI in-process."""
    full_env = {"FLYWHEEL_TOKEN": "", **(env or {})}
    if tmp_run is not None:
        full_env["FLYWHEEL_RUN_DIR"] = str(tmp_run)
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(cli_app, list(args), env=full_env)
    finally:
        get_settings.cache_clear()


def audit(db_url: str, action: str) -> list[AuditLog]:
    with Session(get_engine(db_url)) as session:
        return list(session.scalars(select(AuditLog).where(AuditLog.action == action).order_by(AuditLog.id)))


@pytest.fixture(scope="module")
def admin_token(db_url: str, server: str) -> str:
    """The first admin token, made by the CLI's bootstrap (no token existed)."""
    result = flywheel("tokens", "create", "--name", "root", "--role", "admin", "--db-url", db_url, "--url", server)
    assert result.exit_code == 0, result.output
    assert "created the first admin token" in result.stderr and "bootstrap" in result.stderr
    token = result.stdout.strip()
    assert token.startswith("fwo_") and "\n" not in token
    [row] = audit(db_url, "token.create")
    assert row.details == {"bootstrap": True} and row.actor.startswith("cli:") and row.success
    return token


@pytest.fixture(scope="module")
def ops_token(admin_token: str, server: str) -> str:
    result = flywheel(
        "tokens", "create", "--name", "ops", "--role", "operator", "--url", server, env={"FLYWHEEL_TOKEN": admin_token}
    )
    assert result.exit_code == 0, result.output
    assert "store it now" in result.stderr
    return result.stdout.strip()


def test_bootstrap_is_refused_once_an_admin_exists(db_url, server, admin_token):
    again = flywheel("tokens", "create", "--name", "root2", "--role", "admin", "--db-url", db_url, "--url", server)
    assert again.exit_code == 1 and "an active admin token exists" in again.output
    viewer = flywheel("tokens", "create", "--name", "v", "--role", "viewer", "--db-url", db_url, "--url", server)
    assert viewer.exit_code == 1 and "needs an admin token" in viewer.output


def test_tokens_list_create_revoke(server, admin_token, ops_token):
    env = {"FLYWHEEL_TOKEN": admin_token}
    created = flywheel("tokens", "create", "--name", "temp", "--role", "viewer", "--url", server, env=env)
    assert created.exit_code == 0, created.output
    temp = created.stdout.strip()
    listed = flywheel("tokens", "list", "--url", server, env=env)
    assert listed.exit_code == 0 and "temp" in listed.output and "ops" in listed.output and temp not in listed.output
    token_id = next(line.split()[0] for line in listed.output.splitlines() if " temp " in line)
    revoked = flywheel("tokens", "revoke", token_id, "--url", server, env=env)
    assert revoked.exit_code == 0 and "revoked token" in revoked.output
    refused = flywheel("canary", "status", "--url", server, env={"FLYWHEEL_TOKEN": temp})
    assert refused.exit_code == 1 and "HTTP 401" in refused.output and "revoked" in refused.output
    by_operator = flywheel("tokens", "list", "--url", server, env={"FLYWHEEL_TOKEN": ops_token})
    assert by_operator.exit_code == 1 and "needs the admin role" in by_operator.output


def test_checkpoints_list_and_show(db_url, server, ops_token):
    with Session(get_engine(db_url)) as session:
        session.add(
            Checkpoint(
                id="ck-cli",
                policy_version="ck-cli",
                base_model="/m",
                path="/m",
                format="full",
                status="candidate",
                eval={"heldout": {"k": {"success_rate": 0.375, "n": 8}}},
            )
        )
        session.commit()
    env = {"FLYWHEEL_TOKEN": ops_token}
    listed = flywheel("checkpoints", "--url", server, env=env)  # no subcommand: list
    assert listed.exit_code == 0, listed.output
    assert "ck-cli" in listed.output and "0.375" in listed.output
    shown = flywheel("checkpoints", "show", "ck-cli", "--url", server, env=env)
    assert shown.exit_code == 0 and '"policy_version": "ck-cli"' in shown.output
    missing = flywheel("checkpoints", "show", "nope", "--url", server, env=env)
    assert missing.exit_code == 1 and "HTTP 404 not_found: no checkpoint 'nope' in the registry" in missing.output


def test_deployment_commands_print_the_reason_and_are_audited(db_url, server, ops_token, fleet):
    env = {"FLYWHEEL_TOKEN": ops_token}
    deploy = flywheel("deploy", "nope", "--weight", "0.05", "--url", server, env=env)
    assert deploy.exit_code == 1 and "HTTP 404 not_found: no checkpoint 'nope'" in deploy.output
    assert flywheel("deploy", "ck-cli", "--weight", "0", "--url", server, env=env).exit_code == 1
    promote = flywheel("promote", "--reason", "looks good", "--url", server, env=env)
    assert promote.exit_code == 1 and "HTTP 409 conflict" in promote.output
    rollback = flywheel("rollback", "--to", "ck-cli", "--url", server, env=env)
    assert rollback.exit_code == 1 and "HTTP 409 conflict" in rollback.output and "no active stable" in rollback.output
    weight = flywheel("canary", "weight", "0.25", "--url", server, env=env)
    assert weight.exit_code == 1 and "no active canary" in weight.output
    pin = flywheel("pin", "agent", "ck-cli", "--url", server, env=env)
    assert pin.exit_code == 1 and "HTTP 409 conflict" in pin.output and "agent role 'agent' is trained" in pin.output
    unpin = flywheel("unpin", "subagent", "--url", server, env=env)
    assert unpin.exit_code == 1 and "HTTP 404 not_found: agent role 'subagent' is not pinned" in unpin.output
    for action in ("deploy.canary", "deploy.promote", "deploy.rollback", "deploy.weight", "deploy.pin", "deploy.unpin"):
        rows = audit(db_url, action)
        assert rows and all(r.actor == "token:ops" and not r.success for r in rows), action
    assert audit(db_url, "deploy.promote")[-1].details["reason"] == "looks good"


def test_canary_and_viewer_refusal(server, admin_token, ops_token, db_url):
    env = {"FLYWHEEL_TOKEN": ops_token}
    paused = flywheel("canary", "pause", "--reason", "investigating", "--url", server, env=env)
    assert paused.exit_code == 0 and "PAUSED by token:ops" in paused.output and "investigating" in paused.output
    status = flywheel("canary", "--url", server, env=env)  # no subcommand: status
    assert status.exit_code == 0 and "canary controller: PAUSED by token:ops" in status.output
    resumed = flywheel("canary", "resume", "--url", server, env=env)
    assert resumed.exit_code == 0 and "canary controller: running" in resumed.output
    assert [r.actor for r in audit(db_url, "canary.pause")] == ["token:ops"]

    created = flywheel(
        "tokens",
        "create",
        "--name",
        "watcher",
        "--role",
        "viewer",
        "--url",
        server,
        env={"FLYWHEEL_TOKEN": admin_token},
    )
    viewer = {"FLYWHEEL_TOKEN": created.stdout.strip()}
    refused = flywheel("canary", "pause", "--url", server, env=viewer)
    assert refused.exit_code == 1 and "HTTP 403 forbidden: this route needs the operator role" in refused.output


def record_decision(db_url: str, fleet: str, deployment_id: int, action: str, reason: str) -> None:
    """A ``canary.decision`` audit row as the canary controller writes it (``details`` hold every number)."""
    with Session(get_engine(db_url)) as session:
        session.add(
            AuditLog(
                actor="canary-controller",
                action="canary.decision",
                target=f"deployment:{deployment_id}",
                before={"weight": 0.05},
                after={"weight": 0.05, "action": action},
                details={"action": action, "reason": reason, "fleet": fleet, "weight": 0.05},
                success=True,
            )
        )
        session.commit()


def test_canary_status_shows_the_controllers_last_decision(server, ops_token, db_url, fleet):
    env = {"FLYWHEEL_TOKEN": ops_token}
    none_yet = flywheel("canary", "status", "--url", server, env=env)
    assert none_yet.exit_code == 0 and "last decision: none" in none_yet.output
    record_decision(db_url, fleet, 7, "hold", "collecting: 3 of 50 canary sessions at step 0")
    record_decision(db_url, fleet, 7, "rollback", "regression: upper bound -0.0412 < 0")
    record_decision(db_url, f"{fleet}-other", 8, "promote", "non-inferior: lower bound -0.01 > -0.05")

    status = flywheel("canary", "status", "--url", server, env=env)
    assert status.exit_code == 0, status.output
    [line] = [line for line in status.output.splitlines() if line.startswith("last decision:")]
    assert line.startswith("last decision: rollback on deployment:7 at ")
    assert line.endswith(": regression: upper bound -0.0412 < 0")
    answer = json.loads(flywheel("canary", "status", "--json", "--url", server, env=env).stdout)
    decision = answer["last_decision"]
    assert (decision["action"], decision["reason"], decision["target"], decision["success"]) == (
        "rollback",
        "regression: upper bound -0.0412 < 0",
        "deployment:7",
        True,
    )
    [row] = [r for r in audit(db_url, "canary.decision") if r.details["action"] == "rollback"]
    assert datetime.fromisoformat(decision["at"]) == row.at and f" at {decision['at']}: " in line


def test_status_shows_stack_and_fleet(server, ops_token, tmp_path, fleet):
    env = {"FLYWHEEL_TOKEN": ops_token, "FLYWHEEL_SERVING__ADMIN_URL": server}
    fleet_only = flywheel("status", "--no-stack", env=env)
    assert fleet_only.exit_code == 0, fleet_only.output
    assert f"fleet {fleet}" in fleet_only.output and "stable  none" in fleet_only.output
    assert "trainer: running" in fleet_only.output and "canary controller: running" in fleet_only.output
    both = flywheel("status", "--stack", env=env, tmp_run=tmp_path / "run")  # an admin URL alone: no stack
    assert "flywheel stack" in both.output and "not up" in both.output and f"fleet {fleet}" in both.output
    assert both.exit_code == 1  # nothing of the local stack runs in this run folder
    unreachable = flywheel("status", "--no-stack", "--url", "http://127.0.0.1:9", env=env)
    assert unreachable.exit_code == 2 and "cannot reach the admin API at http://127.0.0.1:9" in unreachable.output


def test_audit_command(server, ops_token):
    result = flywheel("audit", "--prefix", "token.", "--url", server, env={"FLYWHEEL_TOKEN": ops_token})
    assert result.exit_code == 0 and "token.create" in result.output and "cli:" in result.output
    failed = flywheel("audit", "--failed", "--url", server, env={"FLYWHEEL_TOKEN": ops_token})
    assert failed.exit_code == 0 and "FAIL" in failed.output and "ok  " not in failed.output


def test_the_installed_console_script(server, ops_token):
    env = {**os.environ, "FLYWHEEL_TOKEN": ops_token, "FLYWHEEL_SERVING__ADMIN_URL": server}
    script = Path(sys.executable).with_name("flywheel")
    result = subprocess.run(
        [str(script), "checkpoints", "list", "--json"], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert '"total"' in result.stdout


def test_flywheel_serving_admin_serves_the_api(db_url, ops_token):
    """The compose entry point: ``flywheel-serving admin --host --port`` in its own process."""
    from conftest import free_port

    port = free_port()
    env = {**os.environ, "FLYWHEEL_POSTGRES__URL": db_url, "FLYWHEEL_ENVIRONMENT": "test"}
    script = Path(sys.executable).with_name("flywheel-serving")
    proc = subprocess.Popen(
        [str(script), "admin", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert httpx.get(f"{url}/v1/fleet", timeout=5).status_code == 401
        answer = httpx.get(f"{url}/v1/trainer", headers={"Authorization": f"Bearer {ops_token}"}, timeout=5)
        assert answer.status_code == 200 and answer.json()["paused"] is False
    finally:
        proc.terminate()
        proc.wait(timeout=20)
