"""Deployment refusals, audit rows and the fleet lock against a real Postgres (no vLLM needed).

Every refusal here happens before a replica is contacted: the replica rows point at ports
nothing listens on, so a test that reached a replica would fail loudly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import AuditLog, Checkpoint, Deployment, Replica
from flywheel.core.settings import Settings
from flywheel.stack.vllm import policy_version_of
from serving.fleet.deploy import DeployError, deploy_canary, promote, reconcile, rollback, set_canary_weight
from serving.fleet.registry import ensure_fleet, fleet_lock, fleet_status

pytestmark = pytest.mark.integration

FLEET = "unit-fleet"


@pytest.fixture(scope="module")
def engine(db_url: str):
    return get_engine(db_url)


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> Settings:
    return Settings(
        environment="test", run_dir=tmp_path, postgres={"url": db_url}, serving={"fleet": FLEET, "canary_replicas": 1}
    )


@pytest.fixture
def dead_urls(unused_port) -> list[str]:
    return [f"http://127.0.0.1:{unused_port()}", f"http://127.0.0.1:{unused_port()}"]


@pytest.fixture
def fleet(engine, settings, base_model_dir: Path, dead_urls: list[str]) -> Iterator[str]:
    """A registered fleet (base as stable) of two replica rows marked serving, plus candidate checkpoints."""
    with Session(engine) as session:
        session.execute(delete(Replica))
        session.execute(delete(Deployment))
        session.execute(delete(AuditLog))
        session.execute(delete(Checkpoint).where(Checkpoint.parent_id.is_not(None)))
        session.commit()
    ensure_fleet(engine, settings, dead_urls, model_dir=base_model_dir)
    base = policy_version_of(base_model_dir)
    with Session(engine) as session:
        for row in session.scalars(select(Replica)):
            row.state, row.policy_version, row.checkpoint_id, row.reason = "serving", base, base, None
        for name, status in (("good", "candidate"), ("bad", "rejected"), ("gone", "deleted")):
            session.add(
                Checkpoint(
                    id=name, policy_version=name, parent_id=base, base_model=str(base_model_dir),
                    path=str(base_model_dir), format="full", status=status, status_reason=f"{status} in test",
                )
            )  # fmt: skip
        session.add(Checkpoint(id="hole", policy_version="hole", parent_id=base, base_model=str(base_model_dir),
                               path=str(base_model_dir / "missing"), format="full", status="candidate"))  # fmt: skip
        session.commit()
    yield base


def deployments(engine) -> list[tuple[str, str, str]]:
    with Session(engine) as session:
        return [
            (d.role, d.checkpoint_id, d.status) for d in session.scalars(select(Deployment).order_by(Deployment.id))
        ]


def last_audit(engine) -> AuditLog:
    with Session(engine) as session:
        return session.scalars(select(AuditLog).order_by(AuditLog.id.desc()).limit(1)).one()


def test_ensure_fleet_records_an_unreachable_replica_as_failed(
    engine, settings, base_model_dir, dead_urls, unused_port
):
    url = f"http://127.0.0.1:{unused_port()}"
    with Session(engine) as session:
        session.execute(delete(Replica))
        session.execute(delete(Deployment))
        session.commit()
    status = ensure_fleet(engine, settings, [url], model_dir=base_model_dir)
    assert status.stable.checkpoint_id == policy_version_of(base_model_dir) and status.stable.weight == 1.0
    [replica] = status.replicas
    assert (replica.url, replica.state, replica.policy_version) == (url, "failed", None)
    assert "did not answer" in replica.reason
    other = settings.model_copy(update={"serving": settings.serving.model_copy(update={"fleet": "other"})})
    with pytest.raises(DeployError, match="registered in fleet 'unit-fleet'"):
        ensure_fleet(engine, other, [url], model_dir=base_model_dir)


@pytest.mark.parametrize(
    ("checkpoint", "weight", "kind", "words"),
    [
        ("nope", 0.1, "not_found", "no checkpoint 'nope'"),
        ("bad", 0.1, "invalid", "is rejected: rejected in test"),
        ("gone", 0.1, "invalid", "is deleted"),
        ("hole", 0.1, "invalid", "does not exist"),
        ("good", 0.0, "invalid", "outside (0, 1]"),
        ("good", 1.5, "invalid", "outside (0, 1]"),
    ],
)
def test_deploy_canary_refuses_bad_requests_without_changing_anything(
    engine, settings, fleet, checkpoint, weight, kind, words
):
    before = deployments(engine)
    with pytest.raises(DeployError) as refused:
        deploy_canary(engine, settings, checkpoint, weight, "ops:test")
    assert refused.value.kind == kind and words in refused.value.message
    assert deployments(engine) == before
    audit = last_audit(engine)
    assert (audit.action, audit.actor, audit.success, audit.details["error"]) == (
        "deploy.canary",
        "ops:test",
        False,
        kind,
    )
    assert audit.target == f"fleet:{FLEET}" and audit.details["checkpoint_id"] == checkpoint


def test_deploy_canary_conflicts(engine, settings, fleet):
    with pytest.raises(DeployError, match="already the stable") as refused:
        deploy_canary(engine, settings, fleet, 0.1, "ops:test")
    assert refused.value.kind == "conflict"
    with Session(engine) as session:
        session.add(Deployment(fleet=FLEET, checkpoint_id="good", role="canary", weight=0.1, status="active"))
        session.commit()
    with pytest.raises(DeployError, match="already has an active canary") as refused:
        deploy_canary(engine, settings, "good", 0.1, "ops:test")
    assert refused.value.kind == "conflict"
    lonely = settings.model_copy(update={"serving": settings.serving.model_copy(update={"fleet": "empty"})})
    with pytest.raises(DeployError, match="no active stable deployment") as refused:
        deploy_canary(engine, lonely, "good", 0.1, "ops:test")
    assert refused.value.kind == "conflict"


def test_a_single_serving_replica_refuses_a_full_weight_canary(engine, settings, fleet, dead_urls):
    with Session(engine) as session:
        session.scalars(select(Replica).where(Replica.url == dead_urls[0])).one().state = "failed"
        session.commit()
    with pytest.raises(DeployError) as refused:
        deploy_canary(engine, settings, "good", 0.1, "ops:test")
    assert refused.value.kind == "conflict"
    assert "1 replica(s) serving the stable" in refused.value.message and "lora" in refused.value.message
    assert deployments(engine) == [("stable", fleet, "active")]


def test_weight_promote_and_rollback_need_what_they_act_on(engine, settings, fleet):
    with pytest.raises(DeployError, match="no active canary") as refused:
        set_canary_weight(engine, settings, 0.5, "ops:test")
    assert refused.value.kind == "conflict"
    with pytest.raises(DeployError, match="no active canary to promote"):
        promote(engine, settings, "ops:test")
    with pytest.raises(DeployError, match="no previous stable") as refused:
        rollback(engine, settings, "ops:test")
    assert refused.value.kind == "not_found"
    with pytest.raises(DeployError, match="no checkpoint 'nope'"):
        rollback(engine, settings, "ops:test", to_checkpoint_id="nope")
    with pytest.raises(DeployError, match="is rejected"):
        rollback(engine, settings, "ops:test", to_checkpoint_id="bad")
    with pytest.raises(DeployError, match="already the stable") as refused:
        rollback(engine, settings, "ops:test", to_checkpoint_id=fleet)
    assert refused.value.kind == "conflict"
    with Session(engine) as session:
        actions = session.execute(
            select(AuditLog.action, func.count()).where(AuditLog.success.is_(False)).group_by(AuditLog.action)
        ).all()
    assert dict(actions) == {"deploy.weight": 1, "deploy.promote": 1, "deploy.rollback": 4}
    assert deployments(engine) == [("stable", fleet, "active")]


def test_set_canary_weight_changes_only_the_weight(engine, settings, fleet):
    with Session(engine) as session:
        session.add(Deployment(fleet=FLEET, checkpoint_id="good", role="canary", weight=0.05, status="active"))
        session.commit()
    out = set_canary_weight(engine, settings, 0.25, "canary-controller", details={"step": 2, "n": 140})
    assert (out["canary"]["weight"], out["canary"]["status"], out["canary"]["checkpoint_id"]) == (
        0.25,
        "active",
        "good",
    )
    audit = last_audit(engine)
    assert (audit.action, audit.success, audit.details["previous_weight"], audit.details["n"]) == (
        "deploy.weight",
        True,
        0.05,
        140,
    )
    assert (audit.before["canary"]["weight"], audit.after["canary"]["weight"]) == (0.05, 0.25)
    assert fleet_status(engine, FLEET).canary.weight == 0.25


def test_the_fleet_lock_refuses_every_operation_while_held(engine, settings, fleet):
    with fleet_lock(engine, FLEET):
        for call in (
            lambda: deploy_canary(engine, settings, "good", 0.1, "ops:test"),
            lambda: set_canary_weight(engine, settings, 0.2, "ops:test"),
            lambda: promote(engine, settings, "ops:test"),
            lambda: rollback(engine, settings, "ops:test"),
            lambda: reconcile(engine, settings),
        ):
            with pytest.raises(DeployError, match="another deployment operation is running") as refused:
                call()
            assert refused.value.kind == "conflict"
        # a registration while an operation runs writes nothing and reports the fleet
        assert ensure_fleet(engine, settings, ["http://127.0.0.1:9"]).stable.checkpoint_id == fleet
        other = settings.model_copy(update={"serving": settings.serving.model_copy(update={"fleet": "another"})})
        with pytest.raises(DeployError, match="no active canary"):
            set_canary_weight(engine, other, 0.2, "ops:test")  # the lock is per fleet
    with Session(engine) as session:
        assert session.scalars(select(Replica).where(Replica.url == "http://127.0.0.1:9")).first() is None
    with pytest.raises(DeployError, match="no active canary"):
        set_canary_weight(engine, settings, 0.2, "ops:test")  # released


def test_reconcile_marks_unreachable_replicas_failed(engine, settings, fleet, dead_urls):
    assert reconcile(engine, settings) == []
    rows = fleet_status(engine, FLEET).replicas
    assert {(r.state, "unreachable" in r.reason) for r in rows} == {("failed", True)}
    audit = last_audit(engine)
    assert audit.action == "deploy.reconcile" and len(audit.details["marked"]) == 2
    assert reconcile(engine, settings) == []  # already failed: nothing new, no audit row
    assert last_audit(engine).id == audit.id


def test_reconcile_ends_a_deployment_an_operation_left_pending_but_not_one_running(engine, settings, fleet):
    """A pending row with the fleet lock free was left by a process that stopped mid-operation: it ends
    failed (the fleet status stops showing a canary being deployed). Under the lock it is left alone."""
    with Session(engine) as session:
        orphan = Deployment(fleet=FLEET, checkpoint_id="good", role="canary", weight=0.1, status="pending")
        session.add(orphan)
        session.commit()
        orphan_id = orphan.id
    assert fleet_status(engine, FLEET).canary.id == orphan_id
    with fleet_lock(engine, FLEET), pytest.raises(DeployError, match="another deployment operation"):
        reconcile(engine, settings)
    assert ("canary", "good", "pending") in deployments(engine)
    reconcile(engine, settings)
    with Session(engine) as session:
        row = session.get(Deployment, orphan_id)
        assert row.status == "failed" and "left pending by an operation that stopped" in row.reason
        assert row.ended_at is not None
    assert fleet_status(engine, FLEET).canary is None
    audit = last_audit(engine)
    assert audit.action == "deploy.reconcile"
    assert audit.details["ended"] == [{"id": orphan_id, "checkpoint_id": "good", "role": "canary", "status": "failed"}]
