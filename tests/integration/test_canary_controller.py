"""The canary controller's look (``run_once``) against real Postgres and the real serving.fleet.deploy.

Every test gets a fresh, migrated database with a stable and a canary deployment of two
registered checkpoints and reward rows shaped like the rewarding worker's (an ``outcome``
component and ``_meta.stats``; see tests/integration/test_rewarding_stream.py). The fleet
has no replicas, so promote and rollback change rows without any swap.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from flywheel.core.db import migrate
from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import AgentSession, AuditLog, Checkpoint, Deployment, RawEvent, Reward
from flywheel.core.settings import Settings
from flywheel.stack import endpoints
from serving.canary.controller import DECISION_ACTION, canary_pause_state, run, run_once, set_canary_paused
from serving.fleet.registry import DeployError

pytestmark = pytest.mark.integration

FLEET = "canary-it"
STABLE, CANARY = "pv-stable", "pv-canary"


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    """A fresh, migrated database of this test alone (dropped afterwards)."""
    url = endpoints.with_database(pg_url, f"canary_scratch_{uuid.uuid4().hex[:10]}")
    endpoints.ensure_database(url)
    migrate.upgrade(url)
    yield get_engine(url)
    get_engine(url).dispose()
    endpoints.drop_database(url)


def make_settings(engine: Engine, tmp_path: Path, **canary: Any) -> Settings:
    return Settings(
        environment="test",
        run_dir=tmp_path / "run",
        postgres={"url": engine.url.render_as_string(hide_password=False)},
        serving={"fleet": FLEET, "canary": canary},
    )


def setup_fleet(engine: Engine, weight: float = 0.05) -> int:
    """Two checkpoints, an active stable (1.0) and an active canary (``weight``); the canary's id."""
    with Session(engine) as session:
        for version, status in ((STABLE, "deployed"), (CANARY, "candidate")):
            session.add(
                Checkpoint(
                    id=version,
                    policy_version=version,
                    base_model="tiny",
                    path=f"/nonexistent/{version}",
                    format="full",
                    status=status,
                )
            )
        session.flush()
        session.add(Deployment(fleet=FLEET, checkpoint_id=STABLE, role="stable", weight=1.0, status="active"))
        canary = Deployment(fleet=FLEET, checkpoint_id=CANARY, role="canary", weight=weight, status="active")
        session.add(canary)
        session.commit()
        return canary.id


def components(success: float | None, stats: dict[str, float] | None = None) -> dict[str, Any]:
    """A reward row's components as the rewarding worker writes them."""
    out: dict[str, Any] = {
        "_meta": {
            "input_hash": "x",
            "n_events": 4,
            "event_ids": [],
            "stats": {
                "completions": 2.0,
                "completion_tokens": 40.0,
                "clarifying": 0.0,
                "tool_results": 1.0,
                "tool_errors": 0.0,
                "edited": 0.0,
                "grm_scored": 0.0,
                "grm_disagree": 0.0,
            }
            | (stats or {}),
        }
    }
    if success is not None:
        out["outcome"] = {"value": success, "terms": {"task_solved": success}, "weight": 1.0, "weighted": success}
    return out


def add_sessions(
    engine: Engine,
    version: str,
    n: int,
    successes: int,
    *,
    failed: int = 0,
    latency_ms: float | None = None,
    revised: int = 0,
    reward: float | None = None,
    outcome: bool = True,
) -> None:
    """``n`` rewarded sessions of ``version``, ``successes`` of them solved, ``failed`` ended failed.

    ``revised`` of the solved ones first get a reward version 1 that says *unsolved* and
    then a version 2 that says solved (the newest version must count). ``reward`` replaces
    the composite reward (default: the success); ``outcome=False`` leaves the outcome out.
    """
    now = datetime.now(UTC)
    with Session(engine) as session:
        for i in range(n):
            sid = f"{version}-{uuid.uuid4().hex[:12]}"
            ok = 1.0 if i < successes else 0.0
            if i < revised and ok:
                session.add(
                    Reward(
                        project="p",
                        session_id=sid,
                        version=1,
                        reward=0.0,
                        components=components(0.0),
                        extractor_versions={"outcome": "1"},
                        config_hash="h" * 64,
                        policy_version=version,
                    )
                )
                session.add(
                    Reward(
                        project="p",
                        session_id=sid,
                        version=2,
                        reward=ok,
                        components=components(ok),
                        extractor_versions={"outcome": "1"},
                        config_hash="h" * 64,
                        policy_version=version,
                        reason="late_feedback",
                    )
                )
            else:
                session.add(
                    Reward(
                        project="p",
                        session_id=sid,
                        version=1,
                        reward=ok if reward is None else reward,
                        components=components(ok if outcome else None),
                        extractor_versions={"outcome": "1"},
                        config_hash="h" * 64,
                        policy_version=version,
                    )
                )
            status = "failed" if i >= n - failed else "completed"
            session.add(
                AgentSession(
                    project="p", session_id=sid, started_at=now, ended_at=now, status=status, policy_versions=[version]
                )
            )
            if latency_ms is not None:
                session.add(
                    RawEvent(
                        event_id=uuid.uuid4(),
                        project="p",
                        session_id=sid,
                        type="completion",
                        schema_version=1,
                        occurred_at=now,
                        payload={"latency_ms": latency_ms + i % 7},
                    )
                )
        session.commit()


def decisions(engine: Engine) -> list[AuditLog]:
    with Session(engine) as session:
        return list(session.scalars(select(AuditLog).where(AuditLog.action == DECISION_ACTION).order_by(AuditLog.id)))


def audit(engine: Engine, action: str) -> list[AuditLog]:
    with Session(engine) as session:
        return list(session.scalars(select(AuditLog).where(AuditLog.action == action).order_by(AuditLog.id)))


def deployment(engine: Engine, deployment_id: int) -> Deployment:
    with Session(engine) as session:
        return session.get(Deployment, deployment_id)


def test_a_clearly_worse_canary_is_rolled_back_with_its_numbers(engine: Engine, tmp_path: Path) -> None:
    canary_id = setup_fleet(engine)
    add_sessions(engine, STABLE, 1500, 750)
    add_sessions(engine, CANARY, 150, 30, revised=20)  # 20 % solved (20 of them only in reward version 2)
    add_sessions(engine, CANARY, 10, 0, outcome=False)  # no outcome yet: not counted for success
    add_sessions(engine, "pv-other", 50, 0)  # another policy version: not in either arm
    decision = run_once(engine, make_settings(engine, tmp_path))
    assert decision is not None and decision.action == "rollback"
    assert decision.reason.startswith("significant regression")
    assert decision.primary["n_canary"] == 150 and decision.primary["mean_canary"] == pytest.approx(0.2)
    assert decision.primary["n_stable"] == 1500 and decision.primary["mean_stable"] == pytest.approx(0.5)
    assert decision.primary["upper"] < 0
    assert deployment(engine, canary_id).status == "rolled_back"

    (row,) = decisions(engine)
    assert row.actor == "canary-controller" and row.success and row.target == f"deployment:{canary_id}"
    assert row.details["action"] == "rollback" and row.details["primary"]["n_canary"] == 150
    assert row.details["primary"]["estimate"] == pytest.approx(-0.3)
    assert row.details["canary"]["policy_version"] == CANARY and row.details["sessions"]["stable"] == 1500
    assert row.details["sessions"]["canary"] == 160
    assert set(row.details["guards"]) >= {"error_rate", "latency_p95", "edit_rate"}
    (deploy_row,) = audit(engine, "deploy.rollback")
    assert deploy_row.actor == "canary-controller" and deploy_row.success
    assert deploy_row.details["decision"]["primary"]["upper"] == row.details["primary"]["upper"]
    assert deploy_row.details["reason"] == decision.reason

    assert run_once(engine, make_settings(engine, tmp_path)) is None  # no active canary any more


def test_the_trainer_leaves_a_rolled_back_canarys_lineage(engine: Engine, tmp_path: Path) -> None:
    """A canary keeps ``candidate`` after its rollback; the trainer's lineage must still drop it.

    Before the fix the trainer kept extending the rolled-back lineage (its members looked on
    trial) while the controller, which deploys only children of the stable, never deployed any
    of them: the loop stalled after the first rollback.
    """
    from trainer.registry import lineage_tip_id

    setup_fleet(engine)
    with Session(engine) as session:
        session.add(Checkpoint(id="child", policy_version="child", parent_id=CANARY, base_model="tiny",
                               path="/nonexistent/child", format="full", status="candidate"))  # fmt: skip
        session.get(Checkpoint, CANARY).parent_id = STABLE
        session.commit()
    with Session(engine) as session:
        assert lineage_tip_id(session, STABLE) == "child"  # the canary is on trial: train on from its child
    add_sessions(engine, STABLE, 1500, 750)
    add_sessions(engine, CANARY, 150, 30)
    decision = run_once(engine, make_settings(engine, tmp_path))
    assert decision is not None and decision.action == "rollback"
    with Session(engine) as session:
        assert session.get(Checkpoint, CANARY).status == "candidate"  # what makes the tried set needed
        assert lineage_tip_id(session, STABLE) == STABLE


def test_a_good_canary_steps_up_then_collects_at_the_new_step(engine: Engine, tmp_path: Path) -> None:
    canary_id = setup_fleet(engine)
    add_sessions(engine, STABLE, 5000, 2500)
    add_sessions(engine, CANARY, 1000, 600)
    settings = make_settings(engine, tmp_path)
    decision = run_once(engine, settings)
    assert decision is not None and (decision.action, decision.new_weight) == ("step_up", 0.25)
    assert decision.primary["lower"] > -settings.serving.canary.step_margin
    assert deployment(engine, canary_id).weight == pytest.approx(0.25)
    (weight_row,) = audit(engine, "deploy.weight")
    assert weight_row.actor == "canary-controller" and weight_row.details["weight"] == 0.25
    assert weight_row.details["decision"]["primary"]["n_canary"] == 1000

    # The step began with the weight change: nothing scored at it yet.
    held = run_once(engine, settings)
    assert held is not None and held.action == "hold" and held.reason.startswith("collecting")
    assert held.canary_at_step == 0 and held.primary["n_canary"] == 1000
    again = run_once(engine, settings)
    assert again is not None and again.action == "hold"
    rows = decisions(engine)
    assert [r.details["action"] for r in rows] == ["step_up", "hold"]  # the unchanged hold is not written again
    assert rows[1].before == {"weight": 0.25} and rows[1].details["canary_at_step"] == 0


def test_a_tripped_error_guard_rolls_back_a_canary_whose_success_is_fine(engine: Engine, tmp_path: Path) -> None:
    canary_id = setup_fleet(engine)
    add_sessions(engine, STABLE, 2000, 1000, failed=40, latency_ms=100.0)
    add_sessions(engine, CANARY, 400, 200, failed=160, latency_ms=100.0)  # 40 % failed vs 2 %
    decision = run_once(engine, make_settings(engine, tmp_path))
    assert decision is not None and decision.action == "rollback"
    assert decision.reason.startswith("guard tripped: error_rate")
    guard = decision.guards["error_rate"]
    assert guard["tripped"] and guard["mean_canary"] == pytest.approx(0.4)
    assert guard["mean_stable"] == pytest.approx(0.02)
    latency = decision.guards["latency_p95"]
    assert not latency["tripped"] and latency["reference_n"] == 2000 and latency["threshold_ms"] == pytest.approx(106.0)
    assert deployment(engine, canary_id).status == "rolled_back"


def test_a_paused_controller_decides_nothing(engine: Engine, tmp_path: Path) -> None:
    setup_fleet(engine)
    add_sessions(engine, STABLE, 1500, 750)
    add_sessions(engine, CANARY, 150, 20)
    with Session(engine) as session:
        state = set_canary_paused(session, True, "cli:ops", "investigating")
        assert state.paused and state.reason == "investigating" and canary_pause_state(session).actor == "cli:ops"
    settings = make_settings(engine, tmp_path)
    assert run_once(engine, settings) is None and decisions(engine) == []
    with Session(engine) as session:
        assert not set_canary_paused(session, False, "cli:ops").paused
    decision = run_once(engine, settings)
    assert decision is not None and decision.action == "rollback"


def test_a_failed_action_is_recorded_and_raised(engine: Engine, tmp_path: Path) -> None:
    canary_id = setup_fleet(engine)
    add_sessions(engine, STABLE, 1500, 750)
    add_sessions(engine, CANARY, 150, 20)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise DeployError("conflict", "an operator is rolling back already")

    with pytest.raises(DeployError, match="rolling back already"):
        actions = {"rollback": refuse, "promote": refuse, "step_up": refuse}
        run_once(engine, make_settings(engine, tmp_path), actions=actions)
    (row,) = decisions(engine)
    assert not row.success and "rolling back already" in row.details["error"]
    assert row.after == {"weight": 0.05, "action": "rollback"}
    assert deployment(engine, canary_id).status == "active"


def test_the_reward_metric_compares_clipped_rewards(engine: Engine, tmp_path: Path) -> None:
    setup_fleet(engine)
    add_sessions(engine, STABLE, 2000, 0, reward=0.5)
    add_sessions(engine, CANARY, 200, 0, reward=3.0)  # clipped to reward_max
    settings = make_settings(engine, tmp_path, metric="reward", reward_min=0.0, reward_max=1.0)
    decision = run_once(engine, settings)
    assert decision is not None and decision.metric == "reward"
    assert decision.primary["mean_canary"] == pytest.approx(1.0)
    assert decision.primary["mean_stable"] == pytest.approx(0.5)
    assert (decision.action, decision.new_weight) == ("step_up", 0.25)


def test_the_loop_reconciles_and_decides(engine: Engine, tmp_path: Path) -> None:
    canary_id = setup_fleet(engine)
    add_sessions(engine, STABLE, 1500, 750)
    add_sessions(engine, CANARY, 150, 20)
    run(make_settings(engine, tmp_path, interval_s=0.1), max_looks=2)
    assert deployment(engine, canary_id).status == "rolled_back"
    assert [r.details["action"] for r in decisions(engine)] == ["rollback"]


def test_auto_deploy_picks_the_newest_gated_candidate_of_the_stable(engine: Engine, tmp_path: Path) -> None:
    from serving.canary.controller import auto_deploy, next_candidate

    with Session(engine) as session:
        session.add(Checkpoint(id=STABLE, policy_version=STABLE, base_model="tiny", path="/nonexistent/s",
                               format="full", status="deployed"))  # fmt: skip
        session.flush()
        session.add(Deployment(fleet=FLEET, checkpoint_id=STABLE, role="stable", weight=1.0, status="active"))
        gated = {"heldout": {"k": {"success_rate": 0.4}}}
        rows = [
            ("old-gated", STABLE, "candidate", gated),
            ("new-gated", STABLE, "candidate", gated),
            ("hand-made", STABLE, "candidate", {}),  # not gated: ops only
            ("rejected", STABLE, "rejected", gated),
            ("other-parent", "old-gated", "candidate", gated),
        ]
        for i, (cid, parent, status, eval_) in enumerate(rows):
            session.add(Checkpoint(id=cid, policy_version=cid, parent_id=parent, base_model="tiny",
                                   path=f"/nonexistent/{cid}", format="full", status=status, eval=eval_,
                                   created_at=datetime(2026, 1, 1, 0, i, tzinfo=UTC)))  # fmt: skip
            session.flush()
        session.commit()
    settings = make_settings(engine, tmp_path, auto_deploy=True, steps=[0.25, 1.0])
    with Session(engine) as session:
        assert next_candidate(session, FLEET).id == "new-gated"
    calls: list[tuple[str, float, str]] = []

    def record(
        _engine: Engine, _settings: Settings, checkpoint_id: str, weight: float, actor: str, details: dict
    ) -> dict:
        calls.append((checkpoint_id, weight, actor))
        with Session(engine) as session:
            session.add(
                Deployment(fleet=FLEET, checkpoint_id=checkpoint_id, role="canary", weight=weight, status="active")
            )
            session.commit()
        return {}

    assert auto_deploy(engine, settings, record) == "new-gated"
    assert calls == [("new-gated", 0.25, "canary-controller")]
    # a canary is active now: nothing more is deployed
    assert auto_deploy(engine, settings, record) is None
    # once that canary is over, the one never deployed is next; the deployed one is never retried
    with Session(engine) as session:
        row = session.scalars(select(Deployment).where(Deployment.role == "canary")).one()
        row.status = "rolled_back"
        session.commit()
    assert auto_deploy(engine, settings, record) == "old-gated"
    # off by default
    assert auto_deploy(engine, make_settings(engine, tmp_path), record) is None
