"""The canary controller: ``GET /v1/canary`` (viewer), ``POST /v1/canary/pause`` and ``/resume`` (operator).

Deploying a canary and changing its weight are deployment operations
(:mod:`serving.admin.routes.deployments`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from serving.admin.audit import set_pause_flag
from serving.admin.deps import AppSettings, DbEngine, DbSession, Operator, Viewer
from serving.admin.errors import ERROR_RESPONSES
from serving.admin.schemas import (
    CanaryStatusPublic,
    PauseRequest,
    PauseStatePublic,
    as_dict,
    decision_public,
    pause_public,
)
from serving.canary.controller import canary_pause_state, latest_decision
from serving.fleet.registry import fleet_status

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.get("/canary", response_model=CanaryStatusPublic, name="canary.show")
def canary_status(viewer: Viewer, settings: AppSettings, engine: DbEngine, session: DbSession) -> CanaryStatusPublic:
    """The canary controller's pause flag and its last decision, and the fleet's canary and stable deployments."""
    serving = settings.serving
    fleet_ = as_dict(fleet_status(engine, serving.fleet))
    state = canary_pause_state(session)
    decision = latest_decision(session, serving.fleet)
    return CanaryStatusPublic(
        fleet=serving.fleet,
        enabled=serving.canary.enabled,
        controller=pause_public(state),
        canary=fleet_.get("canary"),
        stable=fleet_.get("stable"),
        last_decision=decision_public(decision) if decision is not None else None,
    )


@router.post("/canary/pause", response_model=PauseStatePublic, name="canary.pause")
def pause_canary(
    operator: Operator, session: DbSession, request: Request, body: PauseRequest | None = None
) -> PauseStatePublic:
    """Pause the canary controller: it stops stepping, promoting and rolling back until resumed."""
    return set_pause_flag(request, session, "canary", True, operator.actor, body.reason if body else None)


@router.post("/canary/resume", response_model=PauseStatePublic, name="canary.resume")
def resume_canary(
    operator: Operator, session: DbSession, request: Request, body: PauseRequest | None = None
) -> PauseStatePublic:
    """Resume the canary controller."""
    return set_pause_flag(request, session, "canary", False, operator.actor, body.reason if body else None)
