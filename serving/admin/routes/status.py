"""What the fleet serves: ``GET /v1/fleet`` and ``GET /v1/status`` (viewer)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from flywheel.core.pause import pause_state
from serving.admin.deps import AppSettings, DbEngine, DbSession, Viewer
from serving.admin.errors import ERROR_RESPONSES
from serving.admin.schemas import FleetPublic, StatusPublic, as_dict, pause_public
from serving.canary.controller import canary_pause_state
from serving.fleet.registry import fleet_status

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.get("/fleet", response_model=FleetPublic, name="fleet.show")
def fleet(viewer: Viewer, settings: AppSettings, engine: DbEngine) -> dict[str, Any]:
    """The fleet's stable and canary deployments and its replicas (``serving.fleet.registry.fleet_status``)."""
    return as_dict(fleet_status(engine, settings.serving.fleet))


@router.get("/status", response_model=StatusPublic, name="status.show")
def status(viewer: Viewer, settings: AppSettings, engine: DbEngine, session: DbSession) -> StatusPublic:
    """Fleet status plus the trainer's and the canary controller's pause flags."""
    fleet_ = as_dict(fleet_status(engine, settings.serving.fleet))
    trainer, canary = pause_state(session, "trainer"), canary_pause_state(session)
    return StatusPublic(fleet=fleet_, trainer=pause_public(trainer), canary_controller=pause_public(canary))
