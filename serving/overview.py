"""What the flywheel is doing, read from Postgres: the dashboard, the demo's live view, report and benchmark.

Everything here is read from the system of record (the tables the services write), not
from the demo's own bookkeeping, so the picture is the one ops would see.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Engine

from flywheel.core.contracts.checkpoint import CheckpointEval


@dataclass
class CheckpointView:
    """One checkpoint in lineage order, with its held-out and live numbers."""

    id: str
    policy_version: str
    parent_id: str | None
    status: str
    created_at: datetime
    heldout: float | None
    """Held-out success rate from the eval gate (the base model's from its build)."""
    heldout_metrics: dict[str, float] = field(default_factory=dict)
    """The headline suite's own figures (``metrics`` of its result, e.g. PARL's ``critical_steps``)."""
    live_sessions: int = 0
    """Scored sessions this version served (newest reward version per session)."""
    live_success: float | None = None
    """Share of those sessions whose ``task_solved`` outcome was true."""
    live_reward: float | None = None
    """Mean reward of those sessions."""
    deployed_as: str | None = None
    """``stable`` or ``canary`` while active."""
    canary_outcome: str | None = None
    """How its last canary ended: ``promoted``, ``rolled_back``, ``failed`` (``active`` while running;
    None: never a canary)."""


@dataclass
class Snapshot:
    """The state of the loop at one moment."""

    raw_events: int = 0
    sessions: int = 0
    rewards: int = 0
    samples: int = 0
    cycles: dict[str, int] = field(default_factory=dict)
    """Training cycles by status."""
    last_cycle: dict[str, Any] | None = None
    stable: dict[str, Any] | None = None
    canary: dict[str, Any] | None = None
    last_decision: dict[str, Any] | None = None
    checkpoints: list[CheckpointView] = field(default_factory=list)
    promotions: int = 0
    rollbacks: int = 0
    decisions: list[dict[str, Any]] = field(default_factory=list)
    """Every canary decision and deployment change of the audit log, oldest first."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        return _jsonable(out)


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


DEPLOY_ACTIONS = ("deploy.canary", "deploy.weight", "deploy.promote", "deploy.rollback", "canary.decision")
"""Audit actions that tell the deployment story (prefix match on ``deploy.`` and ``canary.``)."""


def snapshot(engine: Engine, fleet: str = "default", with_decisions: bool = False) -> Snapshot:
    """Read the whole picture in a handful of queries."""
    snap = Snapshot()
    with engine.connect() as conn:
        snap.raw_events = conn.execute(text("SELECT count(*) FROM raw_events")).scalar_one()
        snap.sessions = conn.execute(text("SELECT count(*) FROM sessions")).scalar_one()
        snap.rewards = conn.execute(text("SELECT count(*) FROM rewards")).scalar_one()
        snap.samples = conn.execute(text("SELECT count(*) FROM training_samples")).scalar_one()
        snap.cycles = dict(conn.execute(text("SELECT status, count(*) FROM training_cycles GROUP BY status")).all())
        row = (
            conn.execute(
                text(
                    "SELECT id, status, reason, checkpoint_id, started_at, finished_at FROM training_cycles "
                    "ORDER BY id DESC LIMIT 1"
                )
            )
            .mappings()
            .first()
        )
        snap.last_cycle = dict(row) if row else None
        active = (
            conn.execute(
                text(
                    "SELECT d.id, d.role, d.weight, d.status, d.created_at, d.checkpoint_id, c.policy_version "
                    "FROM deployments d JOIN checkpoints c ON c.id = d.checkpoint_id "
                    "WHERE d.fleet = :fleet AND d.status = 'active' AND d.role IN ('stable', 'canary')"
                ),
                {"fleet": fleet},
            )
            .mappings()
            .all()
        )
        for d in active:
            setattr(snap, d["role"], dict(d))
        live = {
            r["policy_version"]: r
            for r in conn.execute(
                text(
                    "SELECT policy_version, count(*) AS n, avg(reward) AS reward, "
                    "avg(CASE WHEN (components->'outcome'->>'value')::float > 0 THEN 1.0 ELSE 0.0 END) AS success "
                    "FROM (SELECT DISTINCT ON (project, session_id) policy_version, reward, components "
                    "      FROM rewards ORDER BY project, session_id, version DESC) newest "
                    "WHERE policy_version IS NOT NULL GROUP BY policy_version"
                )
            ).mappings()
        }
        roles = {d["checkpoint_id"]: d["role"] for d in active}
        outcomes = dict(
            conn.execute(
                text(
                    "SELECT checkpoint_id, status FROM deployments WHERE fleet = :fleet AND role = 'canary' ORDER BY id"
                ),
                {"fleet": fleet},
            ).all()
        )
        for c in conn.execute(
            text(
                "SELECT id, policy_version, parent_id, status, created_at, eval FROM checkpoints "
                "ORDER BY created_at, id"
            )
        ).mappings():
            heldout, heldout_metrics = _heldout(c["eval"])
            lv = live.get(c["policy_version"])
            snap.checkpoints.append(
                CheckpointView(
                    id=c["id"],
                    policy_version=c["policy_version"],
                    parent_id=c["parent_id"],
                    status=c["status"],
                    created_at=c["created_at"],
                    heldout=heldout,
                    heldout_metrics=heldout_metrics,
                    live_sessions=int(lv["n"]) if lv else 0,
                    live_success=float(lv["success"]) if lv and lv["success"] is not None else None,
                    live_reward=float(lv["reward"]) if lv and lv["reward"] is not None else None,
                    deployed_as=roles.get(c["id"]),
                    canary_outcome=outcomes.get(c["id"]),
                )  # fmt: skip
            )
        counts = dict(
            conn.execute(
                text(
                    "SELECT status, count(*) FROM deployments WHERE fleet = :fleet AND role = 'canary' "
                    "AND status IN ('promoted', 'rolled_back') GROUP BY status"
                ),
                {"fleet": fleet},
            ).all()
        )
        snap.promotions = int(counts.get("promoted", 0))
        snap.rollbacks = int(counts.get("rolled_back", 0))
        row = (
            conn.execute(
                text(
                    "SELECT at, actor, action, details, success FROM audit_log WHERE action LIKE 'canary.%' "
                    "ORDER BY id DESC LIMIT 1"
                )
            )
            .mappings()
            .first()
        )
        snap.last_decision = dict(row) if row else None
        if with_decisions:
            snap.decisions = [
                dict(r)
                for r in conn.execute(
                    text(
                        "SELECT at, actor, action, target, before, after, details, success FROM audit_log "
                        "WHERE action LIKE 'deploy.%' OR action LIKE 'canary.%' ORDER BY id"
                    )
                ).mappings()
            ]
    return snap


def _heldout(evaluation: dict[str, Any] | None) -> tuple[float | None, dict[str, float]]:
    """The headline held-out success rate of a checkpoint's ``eval`` column (its gate's, else its first) and
    that result's own ``metrics``."""
    headline = CheckpointEval.parse(evaluation).headline()
    if headline is None:
        return None, {}
    metrics = headline.to_dict().get("metrics")
    if not isinstance(metrics, dict):
        return headline.success_rate, {}
    return headline.success_rate, {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
