"""The trainer's pause flag: ``GET /v1/trainer`` (viewer), ``POST /v1/trainer/pause`` and ``/resume`` (operator)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session

from flywheel.core.pause import pause_state, set_paused
from serving.admin.audit import mark_audited
from serving.admin.deps import DbSession, Operator, Principal, Viewer
from serving.admin.errors import ERROR_RESPONSES
from serving.admin.schemas import PauseRequest, PauseStatePublic, pause_public

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.get("/trainer", response_model=PauseStatePublic, name="trainer.show")
def trainer_status(viewer: Viewer, session: DbSession) -> PauseStatePublic:
    """The trainer's pause flag."""
    return pause_public(pause_state(session, "trainer"))


def _set_paused(
    request: Request, session: Session, operator: Principal, paused: bool, body: PauseRequest | None
) -> PauseStatePublic:
    state = set_paused(session, "trainer", paused, operator.actor, body.reason if body else None)
    mark_audited(request)
    return pause_public(state)


@router.post("/trainer/pause", response_model=PauseStatePublic, name="trainer.pause")
def pause_trainer(
    operator: Operator, session: DbSession, request: Request, body: PauseRequest | None = None
) -> PauseStatePublic:
    """Pause training: later cycles are skipped (reason ``paused``) until resumed."""
    return _set_paused(request, session, operator, True, body)


@router.post("/trainer/resume", response_model=PauseStatePublic, name="trainer.resume")
def resume_trainer(
    operator: Operator, session: DbSession, request: Request, body: PauseRequest | None = None
) -> PauseStatePublic:
    """Resume training."""
    return _set_paused(request, session, operator, False, body)
