"""Deployment operations: ``GET /v1/operations`` and ``GET /v1/operations/{id}`` (viewer).

Read from Postgres, so any admin API process answers for an operation another one runs, and
after a restart; an operation whose lease has lapsed is marked failed (``abandoned``) before
it is answered (:mod:`serving.admin.operations`).
"""

from __future__ import annotations

import uuid
from typing import Literal

from fastapi import APIRouter, Query

from serving.admin.deps import DbEngine, Viewer
from serving.admin.errors import ERROR_RESPONSES, AdminError
from serving.admin.operations import get_operation, list_operations
from serving.admin.schemas import ErrorPublic, OperationPage, OperationPublic, operation_public

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)

Kind = Literal["deploy.canary", "deploy.weight", "deploy.promote", "deploy.rollback"]
State = Literal["queued", "running", "succeeded", "failed"]


@router.get("/operations", response_model=OperationPage, name="operations.list")
def operations(
    viewer: Viewer,
    engine: DbEngine,
    limit: int = Query(20, ge=1, le=500, description="Operations, newest first."),
    state: State | None = Query(None, description="Only this state."),
    kind: Kind | None = Query(None, description="Only this kind."),
    fleet: str | None = Query(None, max_length=64, pattern=r"^[A-Za-z0-9._-]+$", description="Only this fleet."),
) -> OperationPage:
    """Recent deployment operations, newest first."""
    rows = list_operations(engine, limit=limit, fleet=fleet, state=state, kind=kind)
    return OperationPage(items=[operation_public(row) for row in rows], limit=limit)


@router.get(
    "/operations/{operation_id}",
    response_model=OperationPublic,
    name="operations.show",
    responses={404: {"model": ErrorPublic, "description": "No such operation."}},
)
def operation(viewer: Viewer, engine: DbEngine, operation_id: uuid.UUID) -> OperationPublic:
    """One deployment operation: its state, and its result or its error with the reason."""
    row = get_operation(engine, operation_id)
    if row is None:
        raise AdminError(404, f"no operation {operation_id}")
    return operation_public(row)
