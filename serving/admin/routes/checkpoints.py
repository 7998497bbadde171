"""The checkpoint registry: ``GET /v1/checkpoints`` and ``GET /v1/checkpoints/{id}`` (viewer)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Path, Query
from sqlalchemy import func, select

from flywheel.core.db.models import CHECKPOINT_STATUSES, Checkpoint
from serving.admin.deps import DbSession, Viewer
from serving.admin.errors import ERROR_RESPONSES, AdminError
from serving.admin.schemas import (
    ID_PATTERN,
    CheckpointDetailPublic,
    CheckpointPage,
    ErrorPublic,
    checkpoint_detail,
    checkpoint_public,
)

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.get("/checkpoints", response_model=CheckpointPage, name="checkpoints.list")
def list_checkpoints(
    viewer: Viewer,
    session: DbSession,
    limit: int = Query(50, ge=1, le=500, description="Page size."),
    offset: int = Query(0, ge=0, le=2**31 - 1, description="Checkpoints to skip (newest first)."),
    status: Literal[CHECKPOINT_STATUSES] | None = Query(  # type: ignore[valid-type]
        None, description="Only checkpoints of this status."
    ),
) -> CheckpointPage:
    """Checkpoints of the registry, newest first, with status, parent, policy version and held-out eval."""
    query = select(Checkpoint)
    count = select(func.count()).select_from(Checkpoint)
    if status is not None:
        query, count = query.where(Checkpoint.status == status), count.where(Checkpoint.status == status)
    query = query.order_by(Checkpoint.created_at.desc(), Checkpoint.id.desc()).limit(limit).offset(offset)
    rows = list(session.scalars(query))
    total = session.scalar(count) or 0
    return CheckpointPage(items=[checkpoint_public(r) for r in rows], total=total, limit=limit, offset=offset)


@router.get(
    "/checkpoints/{checkpoint_id}",
    response_model=CheckpointDetailPublic,
    name="checkpoints.show",
    responses={404: {"model": ErrorPublic, "description": "No such checkpoint."}},
)
def show_checkpoint(
    viewer: Viewer, session: DbSession, checkpoint_id: str = Path(min_length=1, max_length=64, pattern=ID_PATTERN)
) -> CheckpointDetailPublic:
    """One checkpoint with its metrics, evaluation and data window."""
    row = session.get(Checkpoint, checkpoint_id)
    if row is None:
        raise AdminError(404, f"no checkpoint {checkpoint_id!r} in the registry")
    return checkpoint_detail(row)
