"""The trainer's pause flag: ``GET /v1/trainer`` (viewer), ``POST /v1/trainer/pause`` and ``/resume`` (operator)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from flywheel.core.pause import pause_state
from serving.admin.audit import set_pause_flag
from serving.admin.deps import DbSession, Operator, Viewer
from serving.admin.errors import ERROR_RESPONSES
from serving.admin.schemas import PauseRequest, PauseStatePublic, pause_public

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.get("/trainer", response_model=PauseStatePublic, name="trainer.show")
def trainer_status(viewer: Viewer, session: DbSession) -> PauseStatePublic:
    """The trainer's pause flag."""
    return pause_public(pause_state(session, "trainer"))


@router.post("/trainer/pause", response_model=PauseStatePublic, name="trainer.pause")
def pause_trainer(
    operator: Operator, session: DbSession, request: Request, body: PauseRequest | None = None
) -> PauseStatePublic:
    """Pause training: later cycles are skipped (reason ``paused``) until resumed."""
    return set_pause_flag(request, session, "trainer", True, operator.actor, body.reason if body else None)


@router.post("/trainer/resume", response_model=PauseStatePublic, name="trainer.resume")
def resume_trainer(
    operator: Operator, session: DbSession, request: Request, body: PauseRequest | None = None
) -> PauseStatePublic:
    """Resume training."""
    return set_pause_flag(request, session, "trainer", False, operator.actor, body.reason if body else None)
