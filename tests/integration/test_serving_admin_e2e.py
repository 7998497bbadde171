"""Deploy, weight, promote and roll back through the ``flywheel`` CLI and the admin API, end to end:
two real vLLM replicas of the base model, the real ``serving.fleet.deploy`` hot swaps, a real admin
API server (uvicorn) and Postgres. Nothing is mocked.

The candidate checkpoint is a copy of the base folder registered under its own id and policy
version: the swap reloads it and sets that version, so ``/weight_info`` of each replica says
which checkpoint it serves.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from conftest import ReplicaPair, free_port
from sqlalchemy import select
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from flywheel.cli import app as cli_app
from flywheel.core import vllm_admin
from flywheel.core.auth import create_key
from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import AuditLog, Checkpoint
from flywheel.core.settings import Settings, get_settings
from flywheel.stack.vllm import policy_version_of
from serving.admin.app import create_app
from serving.fleet.registry import ensure_fleet

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]

CANDIDATE = "e2e-candidate-1"


@pytest.fixture(scope="module")
def settings(replica_pair: ReplicaPair, db_url: str) -> Settings:
    """The shared pair's settings with this module's database, fleet and admin port."""
    return replica_pair.settings_with(
        postgres={"url": db_url},
        serving={
            "fleet": "e2e",
            "refresh_s": 0.2,
            "drain_timeout_s": 20.0,
            "canary_replicas": 1,
            "admin_port": free_port(),
        },
    )


@pytest.fixture(scope="module")
def replicas(replica_pair: ReplicaPair) -> list[str]:
    """The session's two warmed-up replicas of the base model, as the module before left them reset."""
    replica_pair.reset()
    return replica_pair.urls


@pytest.fixture(scope="module")
def base_version(base_model_dir: Path) -> str:
    return policy_version_of(base_model_dir)


@pytest.fixture(scope="module")
def fleet(db_url, settings, replicas, base_model_dir, base_version, tmp_path_factory) -> list[str]:
    """The fleet registered (base as stable) and a candidate checkpoint in the registry."""
    engine = get_engine(db_url)
    ensure_fleet(engine, settings, replicas, model_dir=base_model_dir)
    path = tmp_path_factory.mktemp("ckpt") / CANDIDATE
    shutil.copytree(base_model_dir, path)
    with Session(engine) as session:
        session.add(
            Checkpoint(
                id=CANDIDATE,
                policy_version=CANDIDATE,
                parent_id=base_version,
                base_model=str(base_model_dir),
                path=str(path),
                format="full",
                status="candidate",
                status_reason="e2e test checkpoint",
            )
        )
        session.commit()
    return replicas


@pytest.fixture(scope="module")
def server(db_url: str, settings: Settings, fleet) -> Iterator[str]:
    config = uvicorn.Config(
        create_app(settings, get_engine(db_url)),
        host="127.0.0.1",
        port=settings.serving.admin_port,
        log_level="warning",
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.serving.admin_port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield url
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def ops_token(db_url: str) -> str:
    with Session(get_engine(db_url)) as session:
        token = create_key(session, name="ops", role="operator")[1]
        session.commit()
    return token


def flywheel(server: str, token: str, *args: str):
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(cli_app, [*args, "--url", server], env={"FLYWHEEL_TOKEN": token})
    finally:
        get_settings.cache_clear()


def versions(urls: list[str]) -> list[str | None]:
    return [vllm_admin.weight_info(u) for u in urls]


def test_deploy_weight_promote_and_rollback_through_the_cli_and_the_api(db_url, server, ops_token, fleet, base_version):
    result = flywheel(server, ops_token, "deploy", CANDIDATE, "--weight", "0.1", "--wait")
    assert result.exit_code == 0, result.output
    assert "deploy.canary done by token:ops" in result.stdout and " succeeded (" in result.stderr
    assert versions(fleet) == [base_version, CANDIDATE]  # one replica takes the canary, never both

    result = flywheel(server, ops_token, "canary", "weight", "0.5", "--wait")
    assert result.exit_code == 0, result.output
    status = flywheel(server, ops_token, "status", "--no-stack")
    assert status.exit_code == 0, status.output
    assert f"canary  checkpoint={CANDIDATE} version={CANDIDATE} weight=0.50 status=active" in status.output

    result = flywheel(server, ops_token, "promote", "--reason", "non-inferior")  # answers at once ...
    assert result.exit_code == 0 and " queued: deploy.promote " in result.stdout, result.output
    op_id = result.stdout.split()[1]
    result = flywheel(server, ops_token, "ops", "show", op_id, "--wait")  # ... and is followed to its end
    assert result.exit_code == 0 and f"operation {op_id} succeeded: deploy.promote" in result.stdout, result.output
    assert versions(fleet) == [CANDIDATE, CANDIDATE]

    result = flywheel(server, ops_token, "rollback", "--reason", "complaints", "--wait")  # to the previous stable
    assert result.exit_code == 0, result.output
    assert versions(fleet) == [base_version, base_version]

    auth = {"Authorization": f"Bearer {ops_token}"}
    answer = httpx.post(  # the synchronous answer: ?wait=true holds the request until the operation ends
        f"{server}/v1/canary?wait=true",
        json={"checkpoint_id": CANDIDATE, "weight": 0.05},
        headers=auth,
        timeout=900,
    )
    assert answer.status_code == 200 and answer.json()["state"] == "succeeded", answer.text
    result = answer.json()["result"]
    assert result["canary"]["checkpoint_id"] == CANDIDATE and result["actor"] == "token:ops"
    answer = httpx.post(f"{server}/v1/rollback?wait=true", json={}, headers=auth, timeout=900)  # ends the canary
    assert answer.status_code == 200 and answer.json()["result"]["canary"] is None, answer.text
    assert versions(fleet) == [base_version, base_version]

    result = flywheel(server, ops_token, "rollback", "--to", CANDIDATE, "--wait")  # the stable to any checkpoint
    assert result.exit_code == 0, result.output
    assert versions(fleet) == [CANDIDATE, CANDIDATE]
    fleet_now = httpx.get(f"{server}/v1/fleet", headers=auth, timeout=30).json()
    assert fleet_now["stable"]["checkpoint_id"] == CANDIDATE and fleet_now["canary"] is None
    assert {r["policy_version"] for r in fleet_now["replicas"]} == {CANDIDATE}

    with Session(get_engine(db_url)) as session:
        rows = list(
            session.scalars(select(AuditLog).where(AuditLog.action.startswith("deploy.")).order_by(AuditLog.id))
        )
    assert [(r.action, r.actor, r.success) for r in rows] == [
        ("deploy.canary", "token:ops", True),
        ("deploy.weight", "token:ops", True),
        ("deploy.promote", "token:ops", True),
        ("deploy.rollback", "token:ops", True),
        ("deploy.canary", "token:ops", True),
        ("deploy.rollback", "token:ops", True),
        ("deploy.rollback", "token:ops", True),
    ]
    assert rows[2].details["reason"] == "non-inferior" and rows[2].details["token_id"]
    assert (
        rows[2].before["stable"]["checkpoint_id"] == base_version
        and rows[2].after["stable"]["checkpoint_id"] == CANDIDATE
    )
